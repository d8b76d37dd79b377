"""code: compare extracted code with the target, without running it (semantics.md §8.3)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScoreResult,
    SpecModel,
    failed,
    invalid,
    passed,
    require_target,
)
from kiln.evals.text_similarity import code_tokens, jaccard

_FENCE_RE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_LANG_ALIASES = {
    "py": "python", "python3": "python", "rs": "rust", "ts": "typescript", "tsx": "typescript",
    "js": "javascript", "jsx": "javascript", "mjs": "javascript", "cjs": "javascript", "rb": "ruby",
    "kt": "kotlin", "yml": "yaml", "sh": "bash", "shell": "bash", "zsh": "bash",
}
_HASH_COMMENT_LANGS = {"python", "ruby", "bash", "yaml", "toml", "perl", "r", "julia", "elixir", "makefile"}
_CODE_KEYWORDS = (
    "def ", "class ", "import ", "from ", "return", "if ", "for ", "while ", "function ", "fn ", "let ",
    "const ", "var ", "pub ", "use ", "impl ", "struct ", "enum ", "func ", "package ", "public ", "private ",
    "#include", "int ", "void ", "async ", "elif ", "else", "try:", "except", "lambda", "SELECT ", "echo ",
)
_COMMENT_PREFIXES = ("#", "//", "/*", "*", "--")


class AnyBlock(SpecModel):
    kind: Literal["any_block"] = "any_block"


class ExactBlock(SpecModel):
    kind: Literal["exact_block"] = "exact_block"
    strip_comments: bool = False


class TokenSimilarity(SpecModel):
    kind: Literal["token_similarity"] = "token_similarity"
    min_jaccard: float = 0.6


class LineCoverage(SpecModel):
    kind: Literal["line_coverage"] = "line_coverage"
    min_coverage: float = 0.7


CodeStyle = Annotated[AnyBlock | ExactBlock | TokenSimilarity | LineCoverage, Field(discriminator="kind")]


class CodeSpec(SpecModel):
    kind: Literal["code"] = "code"
    language: str | None = None
    style: CodeStyle = TokenSimilarity()


def normalize_language(lang: str | None) -> str | None:
    if lang is None:
        return None
    lang = lang.strip().lower()
    if not lang:
        return None
    return _LANG_ALIASES.get(lang, lang)


def fenced_blocks(text: str) -> list[tuple[str | None, str]]:
    """(normalized language or None, body) for each ``` fence."""
    out = []
    for m in _FENCE_RE.finditer(text):
        info = m.group(1).strip().split()
        out.append((normalize_language(info[0]) if info else None, m.group(2)))
    return out


def looks_like_code(text: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) < 2:
        return False
    has_keyword = any(ln.lstrip().startswith(_CODE_KEYWORDS) for ln in lines)
    has_shape = any(ln[:1] in (" ", "\t") for ln in lines) or any(c in text for c in "{};")
    return has_keyword and has_shape


def extract_code(text: str, language: str | None) -> str | None:
    for lang, body in fenced_blocks(text):
        if language is None or lang == language:
            return body
    if language is None and looks_like_code(text):
        return text
    return None


def _target_code(example: Example, language: str | None) -> str:
    target = require_target(example, "code")
    blocks = fenced_blocks(target)
    if blocks:
        for lang, body in blocks:
            if language is None or lang == language:
                return body
        return blocks[0][1]
    return target


def _strip_line_comment(line: str, markers: tuple[str, ...]) -> str:
    """Cut at a comment marker that is outside quotes (balanced quotes before it)."""
    for i in range(len(line)):
        for marker in markers:
            if line.startswith(marker, i):
                before = line[:i]
                if before.count('"') % 2 == 0 and before.count("'") % 2 == 0:
                    return line[:i]
    return line


def normalize_block(code: str, *, strip_comments: bool, language: str | None) -> list[str]:
    if language in _HASH_COMMENT_LANGS:
        markers: tuple[str, ...] = ("#",)
    elif language is None:
        markers = ("#", "//")
    else:
        markers = ("//",)
    out = []
    for line in code.splitlines():
        if strip_comments:
            line = _strip_line_comment(line, markers)
        line = line.rstrip()
        if line:
            out.append(line)
    return out


def significant_lines(code: str) -> set[str]:
    lines = (ln.strip() for ln in code.splitlines())
    return {ln for ln in lines if len(ln) >= 4 and not ln.startswith(_COMMENT_PREFIXES)}


def score(spec: CodeSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    language = normalize_language(spec.language)
    style = spec.style
    if isinstance(style, AnyBlock):
        found = extract_code(completion_text, language) is not None
        return passed(1.0, "code block found") if found else failed(0.0, "no code block found")
    target = _target_code(example, language)
    code = extract_code(completion_text, language)
    if code is None:
        wanted = f" ({language})" if language else ""
        return invalid(f"no code block{wanted} found in completion")
    if isinstance(style, ExactBlock):
        same = normalize_block(code, strip_comments=style.strip_comments, language=language) == normalize_block(
            target, strip_comments=style.strip_comments, language=language
        )
        return passed(1.0, "code matches target") if same else failed(0.0, "code differs from target")
    if isinstance(style, TokenSimilarity):
        sim = jaccard(code_tokens(target), code_tokens(code))
        detail = f"token jaccard {sim:.3f} (min {style.min_jaccard:g})"
        return passed(sim, detail) if sim >= style.min_jaccard else failed(sim, detail)
    wanted_lines = significant_lines(target)
    coverage = 1.0 if not wanted_lines else len(wanted_lines & significant_lines(code)) / len(wanted_lines)
    detail = f"line coverage {coverage:.3f} (min {style.min_coverage:g})"
    return passed(coverage, detail) if coverage >= style.min_coverage else failed(coverage, detail)
