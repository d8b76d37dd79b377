"""The dashboard in a real browser: headless Debian chromium (selenium, /usr/bin/chromedriver) against
a real `kiln serve` with a tiny model. Each page is checked through what a person sees and then
through the API, and screenshotted at 1280 px and at phone width (390 px) under test-artifacts/ui/.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from .browser import ARTIFACTS, Browser, browser_unavailable
from .conftest import RunningServer, start_server, stop_server
from .test_adapters_server import _peft_archive

REASON = browser_unavailable()
# CI sets KILN_REQUIRE_BROWSER=1 (.ci/run): there a missing browser fails the run instead of skipping.
if REASON is not None and os.environ.get("KILN_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"KILN_REQUIRE_BROWSER=1 but no browser: {REASON}")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=f"no browser: {REASON}")]

ADAPTER = "tone"          # uploaded through the API, for the compare and eval checks
UPLOADED = "ui-upload"    # uploaded through the page
QUESTION = "What is the capital of Zorbania?"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("ui-srv")
    srv = start_server(str(tiny_model_dir), tmp, "--served-model-id", "tiny")
    data = _peft_archive(tiny_model_dir, tmp, ADAPTER, ["q_proj", "v_proj"], seed=3)
    r = httpx.post(srv.url + "/v1/adapters/upload", data={"name": ADAPTER},
                   files={"archive": (f"{ADAPTER}.tar.gz", data, "application/gzip")}, timeout=60)
    assert r.status_code == 200, r.text
    (tmp / f"{UPLOADED}.tar.gz").write_bytes(_peft_archive(tiny_model_dir, tmp, UPLOADED, ["o_proj"], seed=4))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    b = Browser()
    yield b
    b.close()


def api(server: RunningServer, method: str, path: str, **kw):
    r = httpx.request(method, server.url + path, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def wait(browser: Browser, cond, timeout: float = 60.0, what: str = "condition"):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        # pages re-render on every poll: an element found a moment ago may be gone already
        return WebDriverWait(browser.driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=[StaleElementReferenceException]).until(lambda d: cond(d))
    except Exception as e:
        browser.screenshot(f"failed-{what.replace(' ', '-')}")
        raise AssertionError(f"timed out waiting for {what}; console: {browser.console_errors()}") from e


def css(browser: Browser, selector: str, timeout: float = 30.0):
    from selenium.webdriver.common.by import By

    return wait(browser, lambda d: (d.find_elements(By.CSS_SELECTOR, selector) or [None])[0], timeout, selector)


def read(browser: Browser, selector: str, fn, timeout: float = 30.0):
    """fn(element) for a freshly found element, retried while a re-render makes it stale."""
    from selenium.webdriver.common.by import By

    def attempt(d):
        found = d.find_elements(By.CSS_SELECTOR, selector)
        return (fn(found[0]),) if found else None
    return wait(browser, attempt, timeout, selector)[0]


def open_page(browser: Browser, server: RunningServer, hash_: str, ready: str):
    browser.driver.get("about:blank")  # a fresh document each time: a changed hash alone keeps the old one
    browser.driver.get(f"{server.url}/ui/#/{hash_}")
    return css(browser, ready)


def set_value(el, value: str) -> None:
    el.clear()
    el.send_keys(value)


def choose(el, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(el).select_by_value(value)


def shoot(browser: Browser, name: str, ready: str | None = None) -> None:
    """Desktop and phone screenshots; with `ready`, the page is reloaded at each width (charts are
    drawn at the width they are shown at) and `ready` awaited."""
    for mode, width in (("desktop", 1280), ("phone", 390)):
        getattr(browser, mode)()
        if ready:
            browser.driver.refresh()
            css(browser, ready)
        time.sleep(0.4)
        browser.screenshot(f"{name}-{width}")
    browser.desktop()


def answer_text(el) -> str:
    from selenium.webdriver.common.by import By

    return el.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")


# ---- overview ---------------------------------------------------------------------------------------

def test_root_opens_the_overview_with_the_model_id(server, browser):
    browser.driver.get(server.url + "/")
    assert browser.driver.current_url.startswith(server.url + "/ui/")
    wait(browser, lambda d: css(browser, "#model-id").text == "tiny", what="model id")
    device = css(browser, "#tile-device").text
    assert "CPU" in device or "cuda" in device
    assert "base" in css(browser, "#tile-adapter").text
    # the weights it resolved to, not the setting's "auto" alone (an HF folder: dense)
    assert "dense (no quantization) (auto)" in css(browser, "#model-summary").text
    wait(browser, lambda d: "/metrics" in css(browser, "#throughput-source").text
         or "stats/decode" in css(browser, "#throughput-source").text, what="throughput source")
    shoot(browser, "overview", "#model-id")


def test_overview_shows_which_revision_each_replica_serves_and_failed_pushes(server, browser, tiny_model_dir,
                                                                             tmp_path):
    from tests.replicas.http_stand_ins import FakeVllm

    replica, shared, other = FakeVllm(base="tiny"), tmp_path / "loras", "tone-next"
    shared.mkdir()
    data = _peft_archive(tiny_model_dir, tmp_path, other, ["q_proj"], seed=5)
    api(server, "POST", "/v1/adapters/upload", data={"name": other},
        files={"archive": (f"{other}.tar.gz", data, "application/gzip")})
    try:
        api(server, "POST", "/v1/replicas", json={"name": "gpu-ui", "url": replica.url, "kind": "vllm",
                                                  "lora_dir": str(shared)})
        revision = api(server, "POST", f"/v1/adapters/{ADAPTER}/publish", json={"replicas": ["gpu-ui"]})["revision"]
        replica.refuse = lambda name, path: 400  # the next adapter does not arrive
        r = httpx.post(f"{server.url}/v1/adapters/{other}/publish", json={"replicas": ["gpu-ui"]}, timeout=60)
        assert r.status_code == 502, r.text
        open_page(browser, server, "overview", "#model-id")
        text = lambda d: css(browser, "#overview-publications").text  # noqa: E731
        wait(browser, lambda d: "gpu-ui" in text(d) and "push failed" in text(d), what="publications table")
        shown = text(None)
        assert ADAPTER in shown and revision.removeprefix("sha256:")[:12] in shown and "current" in shown
        assert other in shown and "HTTP 400" in shown
        shoot(browser, "overview-publications", "#model-id")
    finally:
        for name in (ADAPTER, other):
            httpx.post(f"{server.url}/v1/adapters/{name}/unpublish", json={"replicas": ["gpu-ui"]}, timeout=60)
        httpx.delete(f"{server.url}/v1/replicas/gpu-ui", timeout=30)
        httpx.delete(f"{server.url}/v1/adapters/{other}", timeout=30)
        replica.close()


# ---- playground -------------------------------------------------------------------------------------

def greedy_settings(browser: Browser, max_tokens: int = 12) -> None:
    set_value(css(browser, "#pg-temperature"), "0")
    set_value(css(browser, "#pg-max-tokens"), str(max_tokens))


def test_playground_streams_the_answer_the_api_gives(server, browser):
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#mode-chat").click()
    greedy_settings(browser)
    css(browser, "#pg-input").send_keys(QUESTION)
    css(browser, "#pg-send").click()
    done = css(browser, "#transcript .msg.assistant[data-done]")
    streamed = answer_text(done)
    expected = api(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12})
    assert streamed == expected["choices"][0]["message"]["content"]
    assert streamed.strip()
    assert int(done.get_attribute("data-chunks")) > 2  # many SSE events, not one JSON body
    assert "finish: length" in done.text


def test_playground_output_schema_holds_the_answer_and_shows_the_parsed_value(server, browser):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#mode-chat").click()
    css(browser, "#pg-clear").click()
    greedy_settings(browser, max_tokens=20)
    browser.driver.find_element("xpath", "//summary[text()='Output JSON schema (response_format)']").click()
    set_value(css(browser, "#pg-schema"), json.dumps(schema))
    css(browser, "#pg-input").send_keys("Is the sea salty?")
    css(browser, "#pg-send").click()
    done = css(browser, "#transcript .msg.assistant[data-done]")
    assert json.loads(answer_text(done))["answer"] in ("yes", "no")
    shown = json.loads(done.find_element("css selector", ".parsed-value pre").text)
    assert shown == json.loads(answer_text(done))   # the tiny model's free text is never this JSON
    set_value(css(browser, "#pg-schema"), "")


def test_correcting_an_answer_stores_it_and_trains_on_it(server, browser):
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#pg-clear").click()
    greedy_settings(browser, 6)
    css(browser, "#pg-input").send_keys(QUESTION)
    css(browser, "#pg-send").click()
    css(browser, "#transcript .msg.assistant[data-done] .corr-open").click()
    set_value(css(browser, ".corr-text"), "Quillton.")
    css(browser, ".corr-save").click()
    wait(browser, lambda d: "correction saved" in css(browser, "#transcript").text, what="correction saved")
    wait(browser, lambda d: css(browser, "#corr-train").is_enabled(), what="train enabled")
    set_value(css(browser, "#corr-output"), "ui-corrections")
    set_value(css(browser, "#corr-epochs"), "2")
    shoot(browser, "playground-correction")
    css(browser, "#corr-train").click()
    job_id = css(browser, "#corr-job-link").text
    job = api(server, "GET", f"/v1/train/jobs/{job_id}")
    assert job["adapter_name"] == "ui-corrections"
    if job["training_data"]["source"] == "inline":  # the fallback: an SFT example built in the page
        assert job["training_data"]["num_rows"] == 1
    deadline = time.monotonic() + 120
    while api(server, "GET", f"/v1/train/status/{job_id}")["state"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, "correction training did not finish"
        time.sleep(0.3)
    assert api(server, "GET", f"/v1/train/status/{job_id}")["state"] == "completed"
    api(server, "POST", "/v1/adapters/unload", json={})  # later checks expect the base model as default


def test_compare_vote_appends_a_row_to_the_chosen_judgment_set(server, browser):
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#mode-compare").click()
    choose(css(browser, "#target-a"), "base")
    choose(css(browser, "#target-b"), f"adapter:{ADAPTER}")
    greedy_settings(browser)
    css(browser, "#pg-input").send_keys("Tell me about the mountains.")
    css(browser, "#pg-send").click()
    a = css(browser, "#answer-a[data-done]")
    b = css(browser, "#answer-b[data-done]")
    choose(css(browser, "#judgment-set"), "__new__")
    set_value(css(browser, "#judgment-new-name"), "ui-votes")
    shoot(browser, "playground-compare")
    css(browser, "#vote-b").click()
    wait(browser, lambda d: "saved" in css(browser, "#vote-result").text, what="vote saved")
    rows = api(server, "GET", "/v1/judgments/ui-votes/rows")["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert f"row {row['id']}, 1 rows now" in css(browser, "#vote-result").text
    assert row["winner"] == "b" and row["adapter_a"] is None and row["adapter_b"] == ADAPTER
    assert row["response_a"] == answer_text(a) and row["response_b"] == answer_text(b)
    assert row["prompt"] == [{"role": "user", "content": "Tell me about the mountains."}]


# ---- adapters ---------------------------------------------------------------------------------------

def test_uploaded_adapter_appears_in_the_list(server, browser):
    open_page(browser, server, "adapters", f'tr[data-adapter="{ADAPTER}"]')
    archive = server.log_path.parent / f"{UPLOADED}.tar.gz"
    css(browser, "#upload-file").send_keys(str(archive))
    assert css(browser, "#upload-name").get_attribute("value") == UPLOADED  # taken from the file name
    css(browser, "#upload-submit").click()
    row = css(browser, f'tr[data-adapter="{UPLOADED}"]')
    assert "KiB" in row.text
    names = [a["name"] for a in api(server, "GET", "/v1/adapters")["available"]]
    assert UPLOADED in names
    shoot(browser, "adapters", f'tr[data-adapter="{UPLOADED}"]')


def test_an_api_error_shows_the_envelope_message_and_hint(server, browser):
    open_page(browser, server, "adapters", "#upload-file")
    set_value(css(browser, "#merge-output"), "../escape")
    css(browser, "#merge-submit").click()
    box = css(browser, ".error")
    r = httpx.post(server.url + "/v1/adapters/merge", json={
        "sources": [{"name": ADAPTER, "weight": 0.5}, {"name": UPLOADED, "weight": 0.5}], "output_name": "../escape"})
    err = r.json()["error"]
    assert r.status_code == 400
    assert css(browser, ".error .error-message").text == err["message"]
    if err["hint"]:
        assert css(browser, ".error .error-hint").text == err["hint"]
    assert f"HTTP 400 · {err['code']}" in box.text


def test_adapter_load_unload_download_and_delete_from_the_list(server, browser, tmp_path):
    archive = (server.log_path.parent / f"{UPLOADED}.tar.gz").read_bytes()
    api(server, "POST", "/v1/adapters/upload", data={"name": "scratch"},
        files={"archive": ("scratch.tar.gz", archive, "application/gzip")})
    browser.driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    open_page(browser, server, "adapters", 'tr[data-adapter="scratch"]')
    row = 'tr[data-adapter="scratch"]'
    browser.driver.find_element("xpath", "//tr[@data-adapter='scratch']//button[text()='Load']").click()
    wait(browser, lambda d: "active" in read(browser, row, lambda e: e.text), what="loaded")
    assert api(server, "GET", "/v1/adapters")["active"] == "scratch"
    browser.driver.find_element("xpath", "//tr[@data-adapter='scratch']//button[text()='Unload']").click()
    wait(browser, lambda d: "active" not in read(browser, row, lambda e: e.text), what="unloaded")
    assert api(server, "GET", "/v1/adapters")["active"] is None
    browser.driver.find_element("xpath", "//tr[@data-adapter='scratch']//button[text()='Download']").click()
    saved = tmp_path / "scratch.tar.gz"
    wait(browser, lambda d: saved.is_file() and saved.stat().st_size > 0, what="download")
    assert saved.read_bytes() == httpx.get(server.url + "/v1/adapters/scratch/download", timeout=60).content
    browser.driver.find_element("xpath", "//tr[@data-adapter='scratch']//button[text()='Delete']").click()
    browser.driver.switch_to.alert.accept()
    wait(browser, lambda d: not d.find_elements("css selector", row), what="row gone")
    assert "scratch" not in [a["name"] for a in api(server, "GET", "/v1/adapters")["available"]]


# ---- training ---------------------------------------------------------------------------------------

def test_training_loss_curve_gains_points_while_the_job_runs(server, browser):
    open_page(browser, server, "training", "#sft-submit")
    set_value(css(browser, "#sft-output"), "ui-sft")
    # Far more steps than the test watches, so the curve's growth is seen on a machine of any speed;
    # the job is cancelled once the chart has redrawn with three different point counts.
    set_value(css(browser, "#sft-epochs"), "5000")
    set_value(css(browser, "#sft-lr"), "0.01")
    set_value(css(browser, "#sft-rank"), "8")
    css(browser, "#sft-submit").click()
    wait(browser, lambda d: "ui-sft" in css(browser, "#train-detail").text, what="job detail")
    job_id = next(j["job_id"] for j in api(server, "GET", "/v1/train/status") if j["adapter_name"] == "ui-sft")
    seen: set[int] = set()
    deadline = time.monotonic() + 180
    while len(seen - {0}) < 3:
        assert time.monotonic() < deadline, f"the curve was seen with {sorted(seen)} points only"
        assert api(server, "GET", f"/v1/train/jobs/{job_id}")["state"] in ("queued", "running")
        seen.add(int(read(browser, "#loss-chart", lambda e: e.get_attribute("data-points"))))
        time.sleep(0.25)
    read(browser, "#train-cancel", lambda e: e.click())  # retried if a poll's re-render made it stale
    deadline = time.monotonic() + 60
    while (detail := api(server, "GET", f"/v1/train/jobs/{job_id}"))["state"] != "cancelled":
        assert time.monotonic() < deadline, "the job was not cancelled"
        time.sleep(0.2)
    wait(browser, lambda d: int(read(browser, "#loss-chart", lambda e: e.get_attribute("data-points")))
         == len(detail["loss_curve"]), what="final curve")
    shoot(browser, "training", "#loss-chart")


def test_cancel_stops_a_running_job(server, browser):
    job_id = api(server, "POST", "/v1/train/sft", json={"examples": [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}],
        "config": {"output_name": "ui-long", "epochs": 5000, "auto_load": False}})["job_id"]
    open_page(browser, server, f"training?job={job_id}", "#train-cancel")
    wait(browser, lambda d: "running" in read(browser, "#train-detail .badge", lambda e: e.text), what="running")
    read(browser, "#train-cancel", lambda e: e.click())  # retried if a poll's re-render made it stale
    deadline = time.monotonic() + 60
    while api(server, "GET", f"/v1/train/status/{job_id}")["state"] != "cancelled":
        assert time.monotonic() < deadline, "the job was not cancelled"
        time.sleep(0.2)
    wait(browser, lambda d: "cancelled" in read(browser, "#train-detail .badge", lambda e: e.text), what="cancelled shown")


def test_a_gated_job_shows_its_gate_outcome_verdict_and_evidence(server, browser):
    # 20 held-out prompts (the gate's minimum of pairs) disjoint from the training rows
    suite = {"name": "ui-gate", "schema_version": 2, "default_scorer": {"kind": "contains", "phrases": ["Quillton"]},
             "generation": {"max_tokens": 4, "temperature": 0},
             "examples": [{"id": f"g{i}", "messages": [{"role": "user", "content": f"Which city is number {i}?"}]}
                          for i in range(20)]}
    api(server, "POST", "/v1/eval/suites", json=suite)
    open_page(browser, server, "training", "#sft-submit")
    set_value(css(browser, "#sft-output"), "ui-gated")
    set_value(css(browser, "#sft-epochs"), "2")
    browser.driver.find_element("xpath", "//summary[text()='Post-training eval gate']").click()
    choose(css(browser, "#sft-post-suite"), "ui-gate")
    choose(css(browser, "#sft-scope"), "held-out")
    css(browser, "#sft-submit").click()
    wait(browser, lambda d: "ui-gated" in read(browser, "#train-detail", lambda e: e.text), what="gated job")

    def decided(_d):
        text = read(browser, "#train-detail", lambda e: e.text)
        return text if "gate" in text and "pending" not in text and "gate evidence" in text else None
    text = wait(browser, decided, 180, "gate outcome")
    job = next(j for j in api(server, "GET", "/v1/train/status") if j["adapter_name"] == "ui-gated")
    assert job["gate_outcome"] in text and job["post_eval_verdict"] in text
    assert job["linked_eval_job_ids"][0] in text
    shoot(browser, "training-gate")


# ---- evals and data ---------------------------------------------------------------------------------

def test_eval_results_show_accuracy_intervals_tags_flips_and_the_report(server, browser):
    suite = {"name": "ui-suite", "schema_version": 2, "default_scorer": {"kind": "regex", "pattern": "[aeiou]{2}"},
             "generation": {"max_tokens": 12, "temperature": 0.8},
             "examples": [{"id": f"ex{i}", "messages": [{"role": "user", "content": f"Tell me a story #{i}"}],
                           "tags": ["even" if i % 2 == 0 else "odd"]} for i in range(8)]}
    api(server, "POST", "/v1/eval/suites", json=suite)
    open_page(browser, server, "evals", "#cmp-submit")
    choose(css(browser, "#cmp-suite"), "ui-suite")
    for box in browser.driver.find_elements("css selector", ".cmp-adapter"):
        if box.is_selected() != (box.get_attribute("value") in ("", ADAPTER)):
            box.click()
    css(browser, "#cmp-submit").click()
    wait(browser, lambda d: "ui-suite" in read(browser, "#eval-detail", lambda e: e.text), what="compare job")
    job_id = api(server, "GET", "/v1/eval/jobs")["jobs"][0]["job_id"]
    assert api(server, "GET", "/v1/eval/jobs")["jobs"][0]["adapters"] == [None, ADAPTER]
    def both_runs_drawn(d):
        # the page polls the job: the chart first shows the runs finished so far, then all of them
        text = read(browser, "#accuracy-chart", lambda e: e.text, timeout=90)
        return text if "<base>" in text and ADAPTER in text else None
    wait(browser, both_runs_drawn, 120, "both runs in the accuracy chart")
    result = api(server, "GET", f"/v1/eval/jobs/{job_id}")
    assert result["state"] == "completed"
    rows = css(browser, "#runs-table").text
    for run in result["runs"]:
        assert f"{100 * run['metrics']['accuracy']:.1f}%" in rows
        ci = run["metrics"]["accuracy_confidence_interval"]
        assert f"{100 * ci['lower']:.1f}% – {100 * ci['upper']:.1f}%" in rows
    assert "even" in css(browser, "#tag-chart").text
    assert ADAPTER in css(browser, "#flips-table").text
    href = css(browser, "#eval-report-link").get_attribute("href")
    report = httpx.get(href, timeout=60)
    assert report.status_code == 200 and "<html" in report.text.lower() and "ui-suite" in report.text
    shoot(browser, "evals", "#accuracy-chart")


def test_data_page_shows_datasets_splits_and_the_judgment_histogram(server, browser):
    rows = "\n".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+{i}?"},
                                              {"role": "assistant", "content": str(2 * i)}]}) for i in range(30))
    api(server, "POST", "/v1/eval/datasets/upload", data={"name": "sums", "format": "sft_chat"},
        files={"file": ("rows.jsonl", rows.encode())})
    open_page(browser, server, "data?judgment=ui-votes", "#winner-histogram")
    sums = css(browser, 'tr[data-dataset="sums"]').text
    counts = api(server, "GET", "/v1/eval/datasets/sums")["split_counts"]
    assert f"{counts['train']} train / {counts['validation']} validation / {counts['holdout']} holdout" in sums
    assert "b 1" in css(browser, 'tr[data-judgment="ui-votes"]').text
    set_value(css(browser, "#compile-holdout"), "0")
    css(browser, "#compile-submit").click()
    wait(browser, lambda d: "SFT rows in dataset ui-votes-sft" in read(browser, "#data-detail", lambda e: e.text), what="compiled")
    assert api(server, "GET", "/v1/eval/datasets/ui-votes-sft")["num_rows"] >= 1
    css(browser, 'tr[data-dataset="ui-votes-sft"]')
    shoot(browser, "data", "#winner-histogram")


def test_a_judgment_set_trains_a_preference_adapter_from_the_data_page(server, browser):
    api(server, "POST", "/v1/judgments", json={"name": "ui-prefs"})
    for i in range(1, 7):
        api(server, "POST", "/v1/judgments/ui-prefs/rows", json={
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "response_a": "A number.",
            "response_b": str(2 * i), "winner": "b"})
    api(server, "POST", "/v1/judgments/ui-prefs/rows", json={
        "prompt": [{"role": "user", "content": "Hi"}], "response_a": "Hello", "response_b": "Hey", "winner": "tie"})
    open_page(browser, server, "data?judgment=ui-prefs", "#dpo-from-judgments")
    assert "6 A/B judgments become DPO pairs" in read(browser, "#judgment-preferences", lambda e: e.text)
    css(browser, "#dpo-from-judgments").click()
    css(browser, "#dpo-submit")  # the training page, its DPO form open on the set
    assert read(browser, "#dpo-judgments", lambda e: e.get_property("value")) == "ui-prefs"
    assert read(browser, "#dpo-output", lambda e: e.get_property("value")) == "ui-prefs-dpo"
    set_value(css(browser, "#dpo-epochs"), "2")
    set_value(css(browser, "#dpo-lr"), "0.001")
    set_value(css(browser, "#dpo-heldout"), "30")
    css(browser, "#dpo-submit").click()
    wait(browser, lambda d: "ui-prefs-dpo" in read(browser, "#train-detail", lambda e: e.text), what="DPO job")
    css(browser, "#dpo-held-out", timeout=180)   # shown once the job has ended
    job = next(j for j in api(server, "GET", "/v1/train/status") if j["adapter_name"] == "ui-prefs-dpo")
    detail = api(server, "GET", f"/v1/train/jobs/{job['job_id']}")
    assert job["state"] == "completed" and job["training_data"]["ties_left_out"] == 1
    held = job["held_out"]
    text = read(browser, "#dpo-held-out", lambda e: e.text)
    assert f"{round(100 * held['preference_accuracy_after'])}%" in text and str(held["pairs"]) in text
    # two series (reward margin, preference accuracy), a point per step each
    assert int(read(browser, "#reward-chart", lambda e: e.get_attribute("data-points"))) == 2 * len(detail["loss_curve"])
    shoot(browser, "training-dpo", "#reward-chart")


def run_distill_form(browser, server, card: str, prefix: str, output: str) -> tuple[dict, dict]:
    """Fill a distillation form (two prompts, a short job), submit it and wait for its held-out KL."""
    css(browser, f"#{card} summary").click()
    set_value(css(browser, f"#{prefix}-prompts"), "What is the capital of Zorbania?\nName Zorbania's capital.")
    set_value(css(browser, f"#{prefix}-output"), output)
    set_value(css(browser, f"#{prefix}-epochs"), "3")
    set_value(css(browser, f"#{prefix}-lr"), "0.01")
    set_value(css(browser, f"#{prefix}-max-new"), "4")
    set_value(css(browser, f"#{prefix}-rank"), "4")
    css(browser, f"#{prefix}-submit").click()
    wait(browser, lambda d: output in read(browser, "#train-detail", lambda e: e.text), what=f"{prefix} job")
    css(browser, "#distill-held-out", timeout=180)   # shown once the job has ended
    job = next(j for j in api(server, "GET", "/v1/train/status") if j["adapter_name"] == output)
    return job, api(server, "GET", f"/v1/train/jobs/{job['job_id']}")


def test_the_distillation_forms_start_opd_and_self_distillation_jobs_and_show_their_kl(server, browser):
    api(server, "POST", "/v1/teachers", json={"alias": "ui-teacher", "kind": "local", "adapter": ADAPTER})
    open_page(browser, server, "training", "#opd-submit")
    choose(css(browser, "#opd-teacher"), "ui-teacher")
    job, detail = run_distill_form(browser, server, "opd-card", "opd", "ui-opd")
    assert job["state"] == "completed" and job["job_type"] == "opd" and job["training_data"]["teacher"] == "ui-teacher"
    held = job["held_out"]
    assert f"{held['kl_to_teacher_before']:.4f}" in read(browser, "#distill-held-out", lambda e: e.text)
    assert int(read(browser, "#kl-chart", lambda e: e.get_attribute("data-points"))) == len(detail["loss_curve"]) > 0
    shoot(browser, "training-opd", "#kl-chart")

    open_page(browser, server, "training", "#self-submit")
    job, detail = run_distill_form(browser, server, "self-card", "self", "ui-concise")
    assert job["state"] == "completed" and job["training_data"]["self_distill_mode"] == "conciseness"
    assert int(read(browser, "#kl-chart", lambda e: e.get_attribute("data-points"))) == len(detail["loss_curve"]) > 0


def test_recent_requests_page_shows_the_table_or_says_the_route_is_missing(server, browser):
    has_route = httpx.get(server.url + "/v1/stats/recent-requests", timeout=10).status_code == 200
    # a request of its own, so the table has a row when this test runs alone
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    open_page(browser, server, "requests", "#recent-table" if has_route else "#recent-missing")
    if has_route:
        wait(browser, lambda d: "tiny" in css(browser, "#recent-table").text or "chatcmpl" in css(browser, "#recent-table").text,
             what="recent rows")
    shoot(browser, "requests", "#recent-table" if has_route else "#recent-missing")


# ---- routes other servers have: answered in the page by a stand-in fetch ---------------------------

# Injected before the page's own scripts: answers the listed "METHOD /path" keys with canned JSON
# (or, for {"__sse__": [chunks]}, an event stream of those chunks),
# records what the page sent, and hands everything else to the real server. With `key`, every /v1/*
# and /ui/api/* call without `Authorization: Bearer <key>` is answered 401 invalid_api_key, as a
# server started with an API key answers.
STAND_IN = """
(() => {
  const routes = %(routes)s, key = %(key)s, real = window.fetch.bind(window);
  window.__kilnSent = [];
  const reply = (status, body) => new Response(JSON.stringify(body), {status, headers: {"content-type": "application/json"}});
  window.fetch = async (input, init = {}) => {
    const url = new URL(typeof input === "string" ? input : input.url, location.href);
    const method = (init.method || "GET").toUpperCase();
    const auth = (init.headers && (init.headers.Authorization || init.headers.authorization)) || "";
    window.__kilnSent.push({method, path: url.pathname, auth, body: typeof init.body === "string" ? JSON.parse(init.body) : null});
    if (key && /^\\/(v1|ui\\/api)\\//.test(url.pathname) && auth !== "Bearer " + key)
      return reply(401, {error: {message: "Missing or invalid API key.", type: "authentication_error", param: null,
                                 code: "invalid_api_key", hint: "Send Authorization: Bearer <key>."}});
    const hit = routes[method + " " + url.pathname];
    if (hit && hit.__sse__)
      return new Response(hit.__sse__.map((c) => "data: " + JSON.stringify(c) + "\\n\\n").join("") + "data: [DONE]\\n\\n",
                          {status: 200, headers: {"content-type": "text/event-stream"}});
    return hit === undefined ? real(input, init) : reply(200, hit);
  };
})();
"""


@pytest.fixture
def stand_in(browser):
    ids = []

    def install(routes: dict, key: str | None = None) -> None:
        source = STAND_IN % {"routes": json.dumps(routes), "key": json.dumps(key)}
        ids.append(browser.driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": source})["identifier"])
        browser.driver.get("about:blank")  # the next page is a new document (a hash change alone is not)

    yield install
    for identifier in ids:
        browser.driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": identifier})
    browser.driver.execute_script("localStorage.clear()")
    browser.driver.get("about:blank")


def sent(browser: Browser, method: str, path: str) -> list[dict]:
    return [r for r in browser.driver.execute_script("return window.__kilnSent") if r["method"] == method and r["path"] == path]


def test_recent_requests_table_shows_each_thinking_budget_outcome(server, browser, stand_in):
    def record(i: int, budget: dict, status: str = "ok") -> dict:
        # the shape GET /v1/stats/recent-requests answers (kiln.traffic.records.CompletionRecord.recent)
        return {"id": f"chatcmpl-{i}", "object": "kiln.recent_request", "request_id": f"req-{i}", "kind": "chat",
                "created": 1_796_000_000 - i, "model": "tiny", "adapter": "base" if i % 2 else "tone",
                "status": status, "finish_reason": "stop" if status == "ok" else "error", "streamed": bool(i % 2),
                "prompt_preview": f"question {i}", "completion_preview": f"answer {i}" if status == "ok" else "",
                "prompt_tokens": 10 + i, "completion_tokens": 5 if status == "ok" else 0, "duration_ms": 120.5,
                "ttft_ms": 12.0 if status == "ok" else None, "num_choices": 1 if status == "ok" else 0,
                "thinking_mode": "template_default", "thinking_budget": budget, "correctable": True}
    unconfigured = {"configured": False, "tokens_source": "unlimited", "time_source": "unlimited"}
    limited = {"configured": True, "tokens_source": "request", "time_source": "unlimited", "max_tokens": 8}
    records = [record(0, {**limited, "applied": True, "triggered": True, "trigger": "tokens", "closed": True,
                          "thinking_tokens": 8, "thinking_time_ms": 30}),
               record(1, {**limited, "applied": True, "triggered": False, "closed": True, "thinking_tokens": 3,
                          "thinking_time_ms": 9}),
               {**record(2, limited, status="rejected"), "error": "Adapter 'nope' not found."},  # refused before the budget applied
               record(3, unconfigured)]
    stand_in({"GET /v1/stats/recent-requests": {"object": "list", "data": records}})
    open_page(browser, server, "requests", "#recent-table")
    rows = wait(browser, lambda d: d.find_elements("css selector", "#recent-table tbody tr[data-request]"), what="rows")
    text = [r.text for r in rows]
    assert len(text) == 4
    assert "forced: token limit" in text[0] and "8 thinking tokens" in text[0]
    assert "closed naturally" in text[1] and "streamed" in text[1]
    assert "unresolved" in text[2] and "error" in text[2]
    assert "no budget" in text[3]
    assert "question 0" in text[0] and "answer 0" in text[0] and "tone" in text[0] and "10 / 5" in text[0]
    assert "rejected" in text[2] and "12 / 0" in text[2]
    assert "Adapter 'nope' not found." in text[2]   # a refused request says why
    shoot(browser, "requests-with-records")


def test_recent_requests_are_listed_by_start_time_newest_first(server, browser, stand_in):
    # the server lists records as they finished: a long request started first can finish last
    def record(rid: str, created: int) -> dict:
        return {"id": rid, "object": "kiln.recent_request", "request_id": rid, "kind": "chat", "created": created,
                "model": "tiny", "adapter": "base", "status": "ok", "finish_reason": "stop", "streamed": False,
                "prompt_preview": rid, "completion_preview": "ok", "prompt_tokens": 3, "completion_tokens": 2,
                "duration_ms": 10.0, "ttft_ms": 1.0, "num_choices": 1, "thinking_mode": "template_default",
                "thinking_budget": {"configured": False, "tokens_source": "unlimited", "time_source": "unlimited"},
                "correctable": True}
    finished = [record("chatcmpl-long", 1_796_000_000), record("chatcmpl-new", 1_796_000_020),
                record("chatcmpl-mid", 1_796_000_010)]
    stand_in({"GET /v1/stats/recent-requests": {"object": "list", "data": finished}})
    open_page(browser, server, "requests", "#recent-table")
    rows = wait(browser, lambda d: d.find_elements("css selector", "#recent-table tbody tr[data-request]"), what="rows")
    assert [r.get_attribute("data-request") for r in rows] == ["chatcmpl-new", "chatcmpl-mid", "chatcmpl-long"]


def test_overview_reads_decode_stats_when_the_server_has_them(server, browser, stand_in):
    # the shape GET /v1/stats/decode answers (kiln.api.routers.stats)
    stand_in({"GET /v1/stats/decode": {"object": "kiln.decode_stats", "tok_per_sec": 123.4, "mean_itl_ms": 8.1,
                                       "p50_itl_ms": 7.9, "p99_itl_ms": 15.2, "sample_count": 42, "window_secs": 60.0,
                                       "span_secs": 0.34, "running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                                       "kv_blocks_used": 0, "kv_blocks_total": 256}})
    open_page(browser, server, "overview", "#model-id")
    wait(browser, lambda d: "123.4 tok/s" in css(browser, "#tile-decode").text, what="decode stats")
    assert "ITL 8.1 ms" in css(browser, "#tile-decode").text
    assert "stats/decode" in css(browser, "#throughput-source").text


def test_corrections_go_to_the_corrections_route_when_it_exists(server, browser, stand_in):
    # the shapes the corrections routes answer (kiln.api.routers.corrections)
    correction = {"object": "kiln.correction", "id": "corr-1", "request_id": "chatcmpl-1",
                  "messages": [{"role": "user", "content": QUESTION}],
                  "corrected": {"role": "assistant", "content": "Quillton."}, "created_at": "2026-12-01T16:00:00.000000Z",
                  "original": {"role": "assistant", "content": "Paris"}, "adapter": "base", "state": "pending",
                  "history": []}
    stand_in({"GET /v1/corrections": {"object": "list", "data": [correction], "counts": {"pending": 1, "trained": 0}},
              "POST /v1/corrections": correction,
              "POST /v1/corrections/train": {"job_id": "train-from-corrections", "state": "queued",
                                             "adapter_name": "fixes-v1", "corrections": ["corr-1"], "replayed": 0,
                                             "message": "Queued SFT job training adapter `fixes-v1` on 1 correction "
                                                        "and 0 rehearsed answers (8 steps)"}})
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#mode-chat").click()
    css(browser, "#pg-clear").click()
    greedy_settings(browser, 4)
    css(browser, "#pg-input").send_keys(QUESTION)
    css(browser, "#pg-send").click()
    css(browser, "#transcript .msg.assistant[data-done] .corr-open").click()
    set_value(css(browser, ".corr-text"), "Quillton.")
    css(browser, ".corr-save").click()
    wait(browser, lambda d: sent(browser, "POST", "/v1/corrections"), what="correction posted")
    body = sent(browser, "POST", "/v1/corrections")[0]["body"]
    assert body["request_id"].startswith("chatcmpl-")
    assert body["corrected"] == {"role": "assistant", "content": "Quillton."}
    assert "1 pending correction" in css(browser, "#corrections-panel").text
    set_value(css(browser, "#corr-output"), "fixes-v1")
    css(browser, "#corr-train").click()
    assert css(browser, "#corr-job-link").text == "train-from-corrections"
    train = sent(browser, "POST", "/v1/corrections/train")[0]["body"]
    assert train == {"config": {"auto_load": True, "output_name": "fixes-v1"}}


def test_playground_shows_reasoning_apart_and_tool_calls_and_sends_every_control(server, browser, stand_in):
    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        choice = {"index": 0, "delta": delta, **({"finish_reason": finish} if finish else {})}
        return {"id": "chatcmpl-think", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
                "choices": [choice], **extra}
    budget = {"configured": True, "applied": True, "tokens_source": "request", "time_source": "unlimited",
              "max_tokens": 16, "triggered": True, "trigger": "tokens", "closed": True, "thinking_tokens": 16,
              "thinking_time_ms": 40}
    stream = [chunk({"role": "assistant"}), chunk({"reasoning_content": "The user wants "}),
              chunk({"reasoning_content": "the weather."}), chunk({"content": "Let me check."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
              chunk({}, "tool_calls", metadata={"thinking_budget": budget})]
    stand_in({"POST /v1/chat/completions": {"__sse__": stream}})
    if UPLOADED not in [a["name"] for a in api(server, "GET", "/v1/adapters")["available"]]:  # run alone
        archive = (server.log_path.parent / f"{UPLOADED}.tar.gz").read_bytes()
        api(server, "POST", "/v1/adapters/upload", data={"name": UPLOADED},
            files={"archive": (f"{UPLOADED}.tar.gz", archive, "application/gzip")})
    open_page(browser, server, "playground", "#pg-input")
    css(browser, "#mode-chat").click()
    css(browser, "#pg-clear").click()
    choose(css(browser, "#target-a"), "composition")
    parts = browser.driver.find_elements("css selector", "#target-a + .composition .comp-part")
    assert len(parts) == 2
    choose(parts[0].find_element("css selector", ".comp-name"), ADAPTER)
    set_value(parts[0].find_element("css selector", ".comp-scale"), "0.5")
    choose(parts[1].find_element("css selector", ".comp-name"), UPLOADED)
    set_value(parts[1].find_element("css selector", ".comp-scale"), "0.25")
    choose(css(browser, "#pg-thinking"), "on")
    set_value(css(browser, "#pg-budget-tokens"), "16")
    set_value(css(browser, "#pg-seed"), "7")
    browser.driver.find_element("xpath", "//summary[text()='Tools (JSON)']").click()
    set_value(css(browser, "#pg-tools"), json.dumps([{"type": "function", "function": {"name": "get_weather"}}]))
    css(browser, "#pg-input").send_keys("Weather in Paris?")
    css(browser, "#pg-send").click()
    done = css(browser, "#transcript .msg.assistant[data-done]")
    assert css(browser, ".reasoning .reasoning-text").get_attribute("textContent") == "The user wants the weather."
    assert answer_text(done) == "Let me check."  # reasoning is not in the answer
    assert "get_weather" in css(browser, ".tool-call").text and '{"city": "Paris"}' in css(browser, ".tool-call").text
    assert "finish: tool_calls" in done.text and "forced closed by the thinking-token budget" in done.text
    body = sent(browser, "POST", "/v1/chat/completions")[-1]["body"]
    assert body["stream"] is True and body["messages"] == [{"role": "user", "content": "Weather in Paris?"}]
    assert body["adapters"] == [{"name": ADAPTER, "scale": 0.5}, {"name": UPLOADED, "scale": 0.25}] and "adapter" not in body
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["thinking_budget_tokens"] == 16
    assert body["seed"] == 7 and body["tools"][0]["function"]["name"] == "get_weather"
    shoot(browser, "playground-reasoning")


def test_a_server_with_an_api_key_gets_it_from_the_person_and_on_every_call(server, browser, stand_in):
    stand_in({}, key="sekrit")
    browser.driver.get(f"{server.url}/ui/#/overview")
    css(browser, "#api-key-dialog")
    assert "Missing or invalid API key." in css(browser, "#api-key-dialog").text
    css(browser, "#api-key-input").send_keys("sekrit")
    css(browser, "#api-key-save").click()
    wait(browser, lambda d: css(browser, "#model-id").text == "tiny", what="model id after the key")
    assert browser.driver.execute_script("return localStorage.getItem('kiln.apiKey')") == "sekrit"
    calls = [r for r in browser.driver.execute_script("return window.__kilnSent") if r["path"].startswith("/v1/")]
    later = calls[[i for i, r in enumerate(calls) if r["auth"]][0]:]
    assert later and all(r["auth"] == "Bearer sekrit" for r in later)
    browser.driver.refresh()  # the stored key is sent from the first call on
    wait(browser, lambda d: css(browser, "#model-id").text == "tiny", what="model id after reload")
    assert not browser.driver.find_elements("css selector", "#api-key-dialog")


def test_overview_shows_live_decode_throughput_under_load(server, browser):
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            httpx.post(server.base_url + "/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Count."}], "max_tokens": 48, "ignore_eos": True})

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        open_page(browser, server, "overview", "#model-id")

        def rate(_d) -> float | None:
            m = re.search(r"([\d.,]+) tok/s", read(browser, "#tile-decode", lambda e: e.text))
            value = float(m.group(1).replace(",", "")) if m else 0.0
            return value if value > 0 else None
        assert wait(browser, rate, 30, "decode tok/s") > 0
        assert re.search(r"ITL [\d.]+ ms", css(browser, "#tile-decode").text)
        wait(browser, lambda d: int(read(browser, "#throughput-chart svg", lambda e: e.get_attribute("data-points"))) >= 3,
             30, "throughput points")
        browser.screenshot("overview-busy-1280")
    finally:
        stop.set()
        worker.join(timeout=60)


def test_pages_raise_no_script_errors(browser):
    # chromium logs every non-2xx fetch (feature detection's 404s, the provoked 400); script errors are bugs
    errors = [e for e in browser.console_errors() if "Failed to load resource" not in e]
    assert not errors, errors
    assert (ARTIFACTS / "overview-1280.png").is_file() and (ARTIFACTS / "overview-390.png").is_file()
