"""Timestamps as RFC 3339 UTC strings with microseconds, so "newest first" orders within a second."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
