"""Imports flow one way: api -> engine, adapters, train, evals, data -> core, model, store; and core,
evals, data and store never import torch (docs/DESIGN.md, each package's docstring).

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

# Higher imports lower (or its own level); never the other way. config, errors and the package root are
# shared by every layer and import no layer themselves; commands, the CLI, bench and testing sit on top.
LAYERS = {
    "config": 0, "errors": 0, "__init__": 0, "contracts": 0,
    "core": 1, "model": 1, "store": 1,
    "engine": 2, "adapters": 2, "train": 2, "evals": 2, "data": 2, "replicas": 2,
    "api": 3,
    "commands": 4, "cli": 4, "bench": 4, "testing": 4,
}
NO_TORCH = {"core", "evals", "data", "store", "config", "errors", "contracts"}
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
        if target in LAYERS and LAYERS[target] > LAYERS[own]:
            problems.append(f"{module} imports {name}: kiln.{own} (layer {LAYERS[own]}) may not import "
                            f"kiln.{target} (layer {LAYERS[target]})")
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


def test_every_kiln_package_has_a_layer():
    packages = {package_of(m) for m, _ in kiln_modules()}
    assert packages - set(LAYERS) == set()


def test_no_module_imports_upward_or_pulls_torch_into_a_pure_layer():
    problems = [p for module, path in kiln_modules() for p in layering_problems(module, path.read_text())]
    assert problems == []


def test_every_package_docstring_says_what_it_owns_and_may_import():
    for pkg in ("core", "model", "engine", "adapters", "train", "evals", "data", "store", "api"):
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


def test_downward_and_type_checking_imports_pass():
    assert layering_problems("kiln.api.planted", "from kiln.engine.chat_request import prepare_chat\n") == []
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.api.state import ServerState\n"
    assert layering_problems("kiln.engine.planted", source) == []


@pytest.mark.parametrize("package", ["core", "evals", "data", "store"])
def test_importing_a_pure_package_loads_no_torch(package):
    code = ("import importlib, pkgutil, sys\n"
            f"p = importlib.import_module('kiln.{package}')\n"
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
