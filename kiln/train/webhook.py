"""The terminal-state webhook (semantics.md §12.2): one JSON POST, 5 s timeout, redirects not followed.

Delivery never changes the job's outcome; what happened (status code or error) is recorded on the job.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import httpx

from kiln.train.jobs import TrainJob

log = logging.getLogger("kiln.train")
TIMEOUT_SECS = 5.0


def webhook_payload(job: TrainJob) -> dict[str, Any]:
    out: dict[str, Any] = {
        "job_id": job.job_id,
        "job_type": job.job_type,
        "status": job.state,
        "adapter_name": job.adapter_name,
        "adapter_path": job.adapter_path,
        "error": job.error,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }
    if job.gate_outcome is not None:  # a gated job's webhook waits for the gate (§8.14)
        out["gate_outcome"] = job.gate_outcome
    return out


def deliver(url: str, payload: dict[str, Any], *, timeout: float = TIMEOUT_SECS,
            transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """POST `payload`; returns {url, status_code} or {url, error}. Never raises."""
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False, transport=transport) as client:
            resp = client.post(url, json=payload)
        if resp.status_code >= 300:
            log.warning("training webhook %s answered %d", url, resp.status_code)
        return {"url": url, "status_code": resp.status_code}
    except httpx.HTTPError as e:
        log.warning("training webhook %s failed: %s", url, e)
        return {"url": url, "error": f"{type(e).__name__}: {e}"}
