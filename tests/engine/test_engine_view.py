"""The engine seam: `Engine` and the tests' `StandInEngine` both offer every member of `EngineView`."""

from __future__ import annotations

import inspect

import pytest

from kiln.engine.serving import Engine
from kiln.engine.view import EngineView
from kiln.testing.stand_in import StandInEngine


def _attributes() -> list[str]:
    return list(EngineView.__annotations__)


def _methods() -> list[str]:
    return [name for name in vars(EngineView) if not name.startswith("_") and name not in EngineView.__annotations__]


@pytest.mark.parametrize("cls", [Engine, StandInEngine])
def test_every_method_of_the_view_exists(cls):
    assert [name for name in _methods() if not callable(getattr(cls, name, None)) and
            not isinstance(getattr(cls, name, None), property)] == []


@pytest.mark.parametrize("cls", [Engine, StandInEngine])
def test_every_attribute_of_the_view_is_set_at_construction(cls):
    init = inspect.getsource(cls.__init__)
    assert [name for name in _attributes() if f"self.{name} =" not in init and f"self.{name}:" not in init] == []


@pytest.mark.parametrize("name", ["generate", "submit", "admit"])
def test_a_stand_in_refuses_work_only_a_running_actor_can_do(name):
    with pytest.raises(NotImplementedError):
        getattr(StandInEngine(), name)([1], None) if name != "admit" else StandInEngine().admit([1])
