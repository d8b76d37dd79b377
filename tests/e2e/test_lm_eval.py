"""lm-evaluation-harness, unchanged, against a real `kiln serve` on a tiny model, in both of its API modes:

- `local-completions` with the remote tokenizer on a local multiple-choice task: loglikelihoods through
  `/compat/v1/completions` (echo + logprobs), tokenization through `/compat/tokenize`; every
  loglikelihood it reports equals the sum of the contract's `/v1/completions` prompt logprobs;
- `local-chat-completions` on a local generate_until task through `/v1/chat/completions`.

The commands are the ones the README documents. No downloads: the tasks read files in lm_eval_tasks/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e
TASKS = Path(__file__).parent / "lm_eval_tasks"
lm_eval_missing = shutil.which("lm_eval", path=str(Path(sys.executable).parent)) is None


def run_lm_eval(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    out = tmp / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp / "hf"), "HF_DATASETS_CACHE": str(tmp / "hf" / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(Path(sys.executable).parent / "lm_eval"), *args, "--include_path", str(TASKS),
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def samples(tmp: Path, task: str) -> list[dict]:
    files = sorted((tmp / "out").rglob(f"samples_{task}_*.jsonl"))
    assert files, list((tmp / "out").rglob("*"))
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def our_loglikelihood(url: str, context: str, continuation: str) -> float:
    """lm-eval's split: context + continuation encoded whole, context alone; the rest is the continuation."""
    def encode(text: str) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    whole, ctx = encode(context + continuation), encode(context)
    body = httpx.post(f"{url}/v1/completions", json={"prompt": whole, "prompt_logprobs": 0}, timeout=60).json()
    entries = body["choices"][0]["prompt_logprobs"]
    return sum(entries[p][str(whole[p])]["logprob"] for p in range(len(ctx), len(whole)))


@pytest.mark.skipif(lm_eval_missing, reason="lm-eval is not installed (the dev extra has it)")
def test_local_completions_multiple_choice_matches_our_scoring(tiny_server, tmp_path):
    proc = run_lm_eval(
        tmp_path, "--model", "local-completions", "--tasks", "kiln_tiny_mc", "--batch_size", "1",
        "--model_args", f"model=tiny,base_url={tiny_server.url}/compat/v1/completions,"
        "tokenizer_backend=remote,num_concurrent=1,max_retries=1,max_length=256")
    print(proc.stdout)
    assert "kiln_tiny_mc" in proc.stdout and "acc" in proc.stdout
    rows = samples(tmp_path, "kiln_tiny_mc")
    assert len(rows) == 6
    checked = 0
    for row in rows:
        for args, resp in zip(row["arguments"].values(), row["filtered_resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            assert float(resp[0]) == pytest.approx(our_loglikelihood(tiny_server.url, context, continuation),
                                                   abs=1e-4)
            checked += 1
    assert checked == 24


@pytest.mark.skipif(lm_eval_missing, reason="lm-eval is not installed (the dev extra has it)")
def test_local_chat_completions_generate_until(tiny_server, tmp_path):
    proc = run_lm_eval(
        tmp_path, "--model", "local-chat-completions", "--tasks", "kiln_tiny_gen", "--apply_chat_template",
        "--model_args", f"model=tiny,base_url={tiny_server.url}/v1/chat/completions,num_concurrent=1,max_retries=1")
    print(proc.stdout)
    assert "kiln_tiny_gen" in proc.stdout and "exact_match" in proc.stdout
    rows = samples(tmp_path, "kiln_tiny_gen")
    assert len(rows) == 4 and all(isinstance(r["filtered_resps"][0], str) for r in rows)
