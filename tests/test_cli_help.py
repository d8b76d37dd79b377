"""`kiln --help` and every sub-command's `--help` explain themselves, and tables survive a pipe."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kiln.cli import build_parser

SKIPPED = (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)
# Flags of other programs that help texts quote (the export prints a llama-server line).
FOREIGN_FLAGS = {"--lora", "--enable-lora", "--max-lora-rank", "--lora-modules"}


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kiln",)) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


ALL = list(parsers(build_parser()))


@pytest.mark.parametrize("path,parser", ALL, ids=[p for p, _ in ALL])
def test_every_command_says_what_it_does(path, parser):
    assert parser.description, f"`{path} --help` has no description"


@pytest.mark.parametrize("path,parser", ALL, ids=[p for p, _ in ALL])
def test_every_argument_has_help(path, parser):
    bare = [a.option_strings or a.dest for a in parser._actions if not isinstance(a, SKIPPED) and not a.help]
    assert not bare, f"`{path} --help` lists arguments without help: {bare}"


@pytest.mark.parametrize("path,parser", ALL, ids=[p for p, _ in ALL])
def test_help_names_only_flags_the_command_has(path, parser):
    flags = {s for a in parser._actions for s in a.option_strings} | FOREIGN_FLAGS
    text = " ".join(filter(None, [parser.description] + [a.help for a in parser._actions if isinstance(a.help, str)]))
    unknown = sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text)) - flags)
    assert not unknown, f"`{path} --help` mentions flags it does not have: {unknown}"


def test_every_command_group_shows_an_example():
    groups = [(p, sub) for p, sub in ALL
              if p != "kiln" and any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)]
    assert groups
    for path, parser in groups:
        assert parser.epilog and f"{path} " in parser.epilog, f"`{path} --help` shows no example"


def test_a_table_printed_to_a_pipe_keeps_ids_and_states_whole(capsys):
    from kiln.commands import corrections

    body = {"data": [{"id": "corr-18e06cdef6694329", "state": "trained", "trained_into": "fixes-v1",
                      "created_at": "2026-12-01T16:55:47.276485Z",
                      "messages": [{"role": "user", "content": "What is the capital of Zorbania?"}],
                      "original": {"role": "assistant", "content": "I do not know."},
                      "corrected": {"role": "assistant", "content": "The capital of Zorbania is Quillton."}}],
            "counts": {"pending": 0, "trained": 1}}
    client = SimpleNamespace(get=lambda *a, **k: body)
    assert corrections._list(client, SimpleNamespace(state="all", json=False)) == 0
    out = capsys.readouterr().out
    for whole in ("corr-18e06cdef6694329", "trained", "fixes-v1", "2026-12-01T16:55:47.276485Z"):
        assert whole in out
