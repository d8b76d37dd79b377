"""Streaming token ids to text without ever emitting half a character.

The prefix/read-offset algorithm of vLLM and TGI: decode a short window of recent tokens twice --
up to the last emitted token, and up to the new one -- and emit the difference. Byte-level BPE
splits one character (an emoji, a CJK ideograph) over several tokens; while the window's text
ends in U+FFFD the character is incomplete, so nothing is emitted until it completes (or `flush`).
Decoding a window in context, rather than each token alone, also keeps the spaces that
sentencepiece-style decoders strip from the first token of a string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context; enough for any decoder's look-behind.
_CONTEXT_TOKENS = 5


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: _Decodes, prompt_ids: Sequence[int], skip_special_tokens: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: no context, so output is exactly decode(generated).
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def step(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is open)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """At the end of generation: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        piece = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        if piece:
            self._pieces.append(piece)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
