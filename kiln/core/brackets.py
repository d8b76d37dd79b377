"""Find the bracket that closes an opening `{` or `[` in text that may hold JSON strings."""

from __future__ import annotations


def matching_close(text: str, start: int) -> int | None:
    """Index just past the bracket closing `text[start]` (same bracket kind), or None if unterminated.
    Brackets inside JSON strings (escapes honoured) do not count."""
    opener = text[start]
    closer = "}" if opener == "{" else "]"
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    return None
