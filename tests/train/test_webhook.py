"""Webhook delivery: one JSON POST, redirects not followed, failures recorded instead of raised."""

from __future__ import annotations

import json

import httpx

from kiln.train.jobs import TrainJob
from kiln.train.webhook import deliver, webhook_payload


def test_the_payload_is_posted_as_json():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), json.loads(request.content)))
        return httpx.Response(204)

    result = deliver("http://hook.test/x", {"job_id": "j"}, transport=httpx.MockTransport(handler))
    assert result == {"url": "http://hook.test/x", "status_code": 204}
    assert seen == [("POST", "http://hook.test/x", {"job_id": "j"})]


def test_a_redirect_is_not_followed():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        return httpx.Response(302, headers={"Location": "http://elsewhere.test/"})

    result = deliver("http://hook.test/x", {}, transport=httpx.MockTransport(handler))
    assert result["status_code"] == 302 and calls == ["http://hook.test/x"]


def test_a_failed_delivery_is_recorded_not_raised():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    result = deliver("http://hook.test/x", {}, transport=httpx.MockTransport(handler))
    assert result["url"] == "http://hook.test/x" and "ConnectError" in result["error"]


def test_the_payload_has_the_fields_the_notes_name():
    job = TrainJob("train-1", "grpo", "a1", {}, {}, "2026-01-01T00:00:00Z", state="failed", error="boom",
                   adapter_path=None)
    payload = webhook_payload(job)
    assert set(payload) == {"job_id", "job_type", "status", "adapter_name", "adapter_path", "error", "timestamp"}
    assert (payload["status"], payload["job_type"], payload["error"]) == ("failed", "grpo", "boom")
