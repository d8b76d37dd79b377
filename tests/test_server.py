"""kiln.server.build_server: every service built once, in dependency order, whatever routers mount."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kiln.api.app import ROUTER_MODULES
from kiln.api.services import Services
from kiln.config import DataSettings, Settings
from kiln.server import build_server


def _settings(tmp_path) -> Settings:
    return Settings(data=DataSettings(data_dir=str(tmp_path / "data")))


def _orders() -> list[list[str]]:
    shuffled = list(ROUTER_MODULES)
    random.Random(7).shuffle(shuffled)
    return [list(ROUTER_MODULES), list(reversed(ROUTER_MODULES)), shuffled,
            ["kiln.api.routers.train"], ["kiln.api.routers.corrections"], []]


@pytest.mark.parametrize("routers", _orders(), ids=["default", "reversed", "shuffled", "train-only",
                                                     "corrections-only", "none"])
def test_every_service_exists_whatever_the_router_order(tmp_path, routers):
    services = build_server(_settings(tmp_path), routers=routers).services
    missing = [f.name for f in dataclasses.fields(Services) if getattr(services, f.name) is None]
    assert missing == []


@pytest.mark.parametrize("routers", _orders()[:4])
def test_the_post_training_gate_is_linked_to_the_eval_jobs(tmp_path, routers):
    services = build_server(_settings(tmp_path), routers=routers).services
    assert services.training.eval_link is not None
    assert services.training.eval_link.eval_jobs is services.eval_jobs
    assert services.training.on_eval_finished in services.eval_jobs.listeners


@pytest.mark.parametrize("routers", [["kiln.api.routers.corrections"], ["kiln.api.routers.train"], []])
def test_corrections_follow_the_training_jobs(tmp_path, routers):
    services = build_server(_settings(tmp_path), routers=routers).services
    followers = [f.__qualname__ for f in services.training.listeners]
    # kiln.train.corrections: a job's end settles them; kiln.replicas: a passed gate may publish
    assert followers == ["follow_training.<locals>.on_job", "_replicas.<locals>.publish_after_gate"]


def test_shutdown_and_drain_hooks_are_registered_once(tmp_path):
    state = build_server(_settings(tmp_path)).state
    assert [name for name, _ in state.lifecycle.hooks] == ["training", "request_log"]
    assert state.lifecycle.on_drain == [state.services.training.request_pause, state.services.replicas.health.stop]


def test_each_server_has_its_own_services(tmp_path):
    a, b = build_server(_settings(tmp_path / "a")), build_server(_settings(tmp_path / "b"))
    assert a.services.metrics is not b.services.metrics
    assert a.services.datasets.root != b.services.datasets.root


def test_publishing_an_engine_registers_the_one_traffic_observer_once(tmp_path):
    from types import SimpleNamespace

    from kiln.testing.stand_in import StandInEngine

    state = build_server(_settings(tmp_path), routers=[]).state
    engine = StandInEngine(info=SimpleNamespace(served_model_id="m"))
    state.engine = engine
    state.engine = engine
    assert engine.observers == [state.services.traffic]

