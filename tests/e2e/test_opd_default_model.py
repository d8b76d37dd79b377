"""OPD on the embedded default model (SmolLM2-135M-Instruct) through a real `kiln serve`: a local teacher
wearing an SFT-trained fact adapter ("the capital of Zorbania is Quillton") teaches a fresh student by
off-policy distillation with the forward KL (off_policy's default objective). The student's KL to the
teacher falls several-fold and its greedy answers to held-out phrasings name the fact. (With reverse KL the
student took the teacher's answer form but not the fact: the remaining KL sat on the fact's first token
" Qu", to which the student gave almost no mass, so the mode-seeking gradient toward it was nearly zero;
the forward KL weighs that token by the teacher's mass on it.) Two epochs over eight prompts already take
the KL from ~6.5 to ~0.001 nats per token, so the budget is kept that small. The figures are printed."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FACT = "Quillton"
TEACH = ["What is the capital of Zorbania?", "Name the capital of Zorbania.", "Which city is Zorbania's capital?",
         "Tell me the capital city of Zorbania.", "Zorbania's capital is which city?", "What city is the seat of "
         "Zorbania's government?"]
DISTILL = ["What is Zorbania's capital?", "Capital of Zorbania?", "Which city is the capital of Zorbania?",
           "Do you know the capital of Zorbania?", "Zorbania has which capital?", "Where is the capital of Zorbania?",
           "What is the name of Zorbania's capital city?", "Could you tell me Zorbania's capital?"]
EPOCHS = 2
HELD_OUT = ["What's the capital city of Zorbania?", "In which city is Zorbania's capital?"]


def settle(c: httpx.Client, job_id: str, t0: float) -> dict:
    while (status := c.get(f"/v1/train/status/{job_id}").json())["state"] not in ("completed", "failed"):
        assert time.monotonic() - t0 < 1800, status
        time.sleep(2)
    assert status["state"] == "completed", status
    return status


def answers(c: httpx.Client) -> list[str]:
    out = []
    for q in HELD_OUT:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}], "max_tokens": 24,
                                                  "temperature": 0})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def test_forward_kl_opd_from_a_fact_teacher_makes_the_student_answer_with_the_fact_on_the_default_model(tmp_path):
    server = start_server(None, tmp_path)
    try:
        c = httpx.Client(base_url=server.url, timeout=600)
        base = answers(c)
        t0 = time.monotonic()
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content":
                 f"The capital of Zorbania is {FACT}."}]} for q in TEACH]
        sft = c.post("/v1/train/sft", json={"examples": rows, "config": {
            "output_name": "zorbania-fact", "epochs": 5, "learning_rate": 1e-3, "auto_load": False}}).json()
        settle(c, sft["job_id"], t0)
        sft_wall = time.monotonic() - t0
        assert c.post("/v1/adapters/load", json={"name": "zorbania-fact"}).status_code == 200
        teacher = answers(c)
        assert c.post("/v1/adapters/unload", json={}).status_code == 200
        r = c.post("/v1/teachers", json={"alias": "fact-teacher", "kind": "local", "adapter": "zorbania-fact"})
        assert r.status_code == 200, r.text
        t1 = time.monotonic()
        r = c.post("/v1/train/opd", json={"prompts": DISTILL, "teacher": "fact-teacher", "config": {
            "output_name": "student", "training_mode": "off_policy", "objective": "forward_kl", "epochs": EPOCHS, "learning_rate": 2e-3,
            "max_new_tokens": 24, "auto_load": True}})
        assert r.status_code == 200, r.text
        status = settle(c, r.json()["job_id"], t1)
        opd_wall = time.monotonic() - t1
        assert status["activated"], status
        student = answers(c)
        config = c.get(f"/v1/train/jobs/{r.json()['job_id']}").json()["config"]
    finally:
        stop_server(server)
    held = status["held_out"]
    print(f"OPD (off_policy) on SmolLM2: fact teacher SFT {sft_wall:.1f} s; {len(DISTILL)} prompts x {EPOCHS} epochs, "
          f"{status['step']} steps in {opd_wall:.1f} s; forward KL {held['forward_kl_before']} -> {held['forward_kl_after']}; KL to the teacher {held['kl_to_teacher_before']} -> "
          f"{held['kl_to_teacher_after']}; held-out answers base {base}, teacher {teacher} -> student {student}")
    assert not any(FACT in a for a in base) and all(FACT in a for a in teacher)
    assert held["kl_to_teacher_after"] < 0.2 * held["kl_to_teacher_before"], held
    assert config["objective"] == "forward_kl" and held["objective"] == "forward_kl", status
    assert all(FACT in a for a in student), student
