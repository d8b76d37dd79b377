"""What the routers reach through `request.app.state.kiln`: settings and the long-lived services."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kiln.config import Settings


@dataclass
class ServerState:
    settings: Settings
    started_at: float = field(default_factory=time.time)
    # The AsyncEngine once the model has loaded; None while loading (health answers 503).
    engine: Any = None
    load_error: str | None = None
    # Stores and job managers, filled by create_app; each router documents what it needs.
    services: dict[str, Any] = field(default_factory=dict)


def get_state(request: Request) -> ServerState:
    return request.app.state.kiln
