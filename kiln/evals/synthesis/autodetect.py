"""auto_detect: pick a scorer from the shape of a target (semantics.md §10.4; first matching rule wins).

0 empty -> exact_match; 1 one letter such as "B", "(C)" or "D." -> multiple_choice A..E; 2 a number ->
numeric_tolerance; 3 a tool call -> tool_call; 4 a fenced block with a language -> code; 5 JSON ->
json_validity; 6 one short line -> exact_match; 7 key phrases -> contains, else exact_match.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kiln.evals.scorers.code import normalize_language
from kiln.evals.text_similarity import key_phrases

EXACT_MATCH: dict[str, Any] = {"kind": "exact_match", "case_sensitive": False, "strip_whitespace": True}
CHOICES = ["A", "B", "C", "D", "E"]
MAX_SHORT_CHARS = 80
MAX_PHRASES = 3

# Finite decimal numbers only: "inf" or "nan" would parse as floats but no numeric scorer accepts them.
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WHITESPACE_AND_COMMAS = re.compile(r"[\s,]+")
_CALL_KEYS = ("tool_calls", "tool_call", "function")


@dataclass(frozen=True)
class Detection:
    scorer: dict[str, Any]
    # A multiple-choice target is rewritten to its bare letter (None = keep the target): the scorer
    # compares letters, so a target of "(B)" would never match the "B" it finds in an answer.
    target: str | None = None

    @property
    def kind(self) -> str:
        return self.scorer["kind"]


def _choice_letter(text: str) -> str | None:
    core = text.strip("(). ")
    return core if len(core) == 1 and "A" <= core <= "Z" else None


def _number(text: str) -> float | None:
    compact = _WHITESPACE_AND_COMMAS.sub("", text)
    return float(compact) if _NUMBER_RE.fullmatch(compact) else None


def _is_tool_call(text: str) -> bool:
    if text.startswith(("```tool_call", "<tool_call>")):
        return True
    if not text.startswith("{"):
        return False
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and (any(k in obj for k in _CALL_KEYS) or ("name" in obj and "arguments" in obj))


def _fence_language(text: str) -> str | None:
    """The language of a text that is a fenced block with a language tag and a closing fence."""
    if not text.startswith("```"):
        return None
    first, sep, rest = text[3:].partition("\n")
    tag = first.strip().split()
    if not sep or not tag or "```" not in rest:
        return None
    return normalize_language(tag[0])


def _is_json(text: str) -> bool:
    if not text.startswith(("{", "[")):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def detect_scorer(target: str) -> Detection:
    text = target.strip()
    if not text:
        return Detection(dict(EXACT_MATCH))
    letter = _choice_letter(text)
    if letter is not None:
        return Detection({"kind": "multiple_choice", "choices": list(CHOICES)}, letter)
    number = _number(text)
    if number is not None:
        if number.is_integer():
            scorer = {"kind": "numeric_tolerance", "atol": 0.0, "rtol": 0.0, "integer_only": True}
        else:
            scorer = {"kind": "numeric_tolerance", "atol": 1e-6, "rtol": 1e-3}
        return Detection(scorer)
    if _is_tool_call(text):
        return Detection({"kind": "tool_call", "name_match": {"kind": "case_insensitive"}, "args": {"kind": "auto"}})
    language = _fence_language(text)
    if language is not None:
        return Detection({"kind": "code", "language": language,
                          "style": {"kind": "token_similarity", "min_jaccard": 0.6}})
    if _is_json(text):
        return Detection({"kind": "json_validity", "require_object": text.startswith("{")})
    if "\n" not in text and len(text) <= MAX_SHORT_CHARS:
        return Detection(dict(EXACT_MATCH))
    phrases = key_phrases(text, MAX_PHRASES)
    if phrases:
        return Detection({"kind": "contains", "phrases": phrases, "mode": "any", "case_sensitive": False})
    return Detection(dict(EXACT_MATCH))
