"""Request preparation reads the served model through a `PromptContext`, never through `Engine`."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln.engine.chat_request as chat_request


def test_chat_preparation_imports_nothing_from_the_engine_facade():
    tree = ast.parse(Path(chat_request.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "kiln.engine.serving" not in imported
    assert "kiln.engine.prompt_context" in imported
