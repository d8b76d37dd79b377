"""Imports follow the tiers docs/DESIGN.md and each package's docstring state, package by package:
`MAY_IMPORT[p]` is every package p may import (besides itself and the shared modules), so an upward
import and a sideways one the tiers forbid (evals importing train, adapters importing engine) both
fail. core, evals, data and store never import torch.

`layering_problems` reads a module's source (imports under `if TYPE_CHECKING:` are not imports at run
time, so they do not count); the planted-module tests show it catches what it should.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KILN = ROOT / "kiln"

# config, errors, contracts and the package root are shared by every package and import none.
SHARED = {"config", "errors", "contracts", "__init__"}
_BASE = {"core", "model", "store"}
_MIDDLE = {"data", "traffic", "evals", "adapters", "engine", "train", "replicas"}
MAY_IMPORT: dict[str, set[str]] = {
    # the base: pure Python (core, store) and the model, which builds on core's types
    "core": set(),
    "store": set(),
    "model": {"core", "store"},
    # the middle tier, ordered: data <- evals <- train; model <- adapters <- engine, train. The
    # engine knows evals' Generator protocol (it implements it); train reaches the engine only
    # through the EngineView it is handed (kiln/engine/view.py, imported for typing alone).
    "data": {"core", "store"},
    # what was served: records, the request log, its export as training rows
    "traffic": {"core", "store", "data"},
    "evals": {"core", "store", "data"},
    "adapters": {"core", "store", "model"},
    "engine": {"core", "store", "model", "adapters", "evals", "traffic"},
    "train": {"core", "store", "model", "data", "evals", "adapters", "traffic"},
    # other servers: their registry and health, publishing stored adapters, evals fanned out over them
    "replicas": {"core", "store", "model", "adapters", "evals"},
    # the HTTP surface, the one place that assembles a server, and the programs on top
    "api": _BASE | _MIDDLE,
    "server": _BASE | _MIDDLE | {"api"},
    "bench": _BASE | _MIDDLE,
    "testing": _BASE | _MIDDLE,
    "commands": _BASE | _MIDDLE | {"api", "server", "bench"},
    "cli": {"commands"},
}
NO_TORCH = {"core", "evals", "data", "traffic", "store", "config", "errors", "contracts"}
# the packages that load torch when imported: a no-torch package may not import them either
TORCH_PACKAGES = {"torch", "kiln.model", "kiln.engine", "kiln.train", "kiln.adapters"}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_imports(tree: ast.Module) -> list[str]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "kiln"]
    return names


def _is_package(name: str) -> bool:
    return (KILN / name).is_dir() or (KILN / f"{name}.py").exists()


def layering_problems(module: str, source: str) -> list[str]:
    """Every import in `source` (the text of kiln module `module`) that breaks the layering."""
    own = package_of(module)
    problems = []
    for name in _runtime_imports(ast.parse(source)):
        if own in NO_TORCH and any(name == t or name.startswith(t + ".") for t in TORCH_PACKAGES):
            problems.append(f"{module} imports {name} (kiln.{own} imports no torch)")
        if not name.startswith("kiln.") or name == "kiln":
            continue
        target = package_of(name)
        if target == own or target in SHARED or not _is_package(target):
            continue
        if target not in MAY_IMPORT.get(own, set()):
            problems.append(f"{module} imports {name}: kiln.{own} may import only "
                            f"{', '.join(sorted(MAY_IMPORT.get(own, set()))) or 'the shared modules'}")
    return problems


def kiln_modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def test_the_tiers_have_no_cycle():
    seen: dict[str, int] = {}

    def depth(package: str, path: tuple[str, ...] = ()) -> int:
        assert package not in path, f"import cycle: {' -> '.join((*path, package))}"
        if package not in seen:
            seen[package] = 1 + max((depth(t, (*path, package)) for t in MAY_IMPORT.get(package, ())), default=0)
        return seen[package]

    for package in MAY_IMPORT:
        depth(package)


def test_every_kiln_package_has_its_imports_stated():
    packages = {package_of(m) for m, _ in kiln_modules()}
    assert packages - set(MAY_IMPORT) - SHARED == set()


def test_no_module_imports_upward_or_pulls_torch_into_a_pure_layer():
    problems = [p for module, path in kiln_modules() for p in layering_problems(module, path.read_text())]
    assert problems == []


def test_every_package_docstring_says_what_it_owns_and_may_import():
    for pkg in ("core", "model", "engine", "adapters", "train", "evals", "data", "traffic", "store", "api"):
        doc = ast.get_docstring(ast.parse((KILN / pkg / "__init__.py").read_text())) or ""
        assert "Imports:" in doc, f"kiln/{pkg}/__init__.py says nothing about what it may import"


# ---- the checker catches what it should ---------------------------------------------------------

def test_a_planted_upward_import_is_caught():
    assert layering_problems("kiln.core.planted", "from kiln.api.state import ServerState\n")
    assert layering_problems("kiln.engine.planted", "import kiln.api.routers.chat\n")
    assert layering_problems("kiln.store.planted", "from kiln.evals.suite import parse_suite\n")


def test_a_planted_torch_import_in_a_pure_layer_is_caught():
    assert layering_problems("kiln.evals.planted", "import torch\n")
    assert layering_problems("kiln.data.planted", "from kiln.engine.serving import Engine\n")


def test_a_planted_sideways_import_the_tiers_forbid_is_caught():
    assert layering_problems("kiln.evals.planted", "from kiln.train.manager import TrainingManager\n")
    assert layering_problems("kiln.data.planted", "from kiln.evals.suite import parse_suite\n")
    assert layering_problems("kiln.adapters.planted", "from kiln.engine.lora_slots import AdapterTarget\n")
    assert layering_problems("kiln.train.planted", "from kiln.engine.serving import Engine\n")
    assert layering_problems("kiln.store.planted", "from kiln.core.sampling import SamplingParams\n")


def test_the_sideways_imports_the_tiers_allow_pass():
    assert layering_problems("kiln.train.planted", "from kiln.evals.gate import decide\n") == []
    assert layering_problems("kiln.engine.planted", "from kiln.adapters.compat import model_spec_from_config\n") == []
    assert layering_problems("kiln.evals.planted", "from kiln.data.datasets import DatasetStore\n") == []


def test_downward_and_type_checking_imports_pass():
    assert layering_problems("kiln.api.planted", "from kiln.engine.chat_request import prepare_chat\n") == []
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.api.state import ServerState\n"
    assert layering_problems("kiln.engine.planted", source) == []


@pytest.mark.parametrize("package", ["core", "evals", "data", "traffic", "store"])
def test_importing_a_pure_package_loads_no_torch(package):
    code = ("import importlib, pkgutil, sys\n"
            f"p = importlib.import_module('kiln.{package}')\n"
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
