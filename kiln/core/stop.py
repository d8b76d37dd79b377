"""Stop strings on streamed text: emit as much as is safe, never any part of a stop string.

Text arrives piece by piece (one detokenized token at a time). A stop string may straddle pieces, so
the matcher holds back the longest tail that is still the start of some stop string and only emits
it once it can no longer become one. When several stop strings occur, the one starting earliest in
the text wins; a match is final as soon as it is complete, the way generation halts right there.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        # An empty stop string would match before every character; it means nothing, so drop it.
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, whether a stop string has matched)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._buffer + text
        match_at, matched = -1, None
        for stop in self.stops:  # longest first, so on equal starts the longest wins
            at = buffer.find(stop)
            if at != -1 and (match_at == -1 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            self.stopped, self.matched, self._buffer = True, matched, ""
            return buffer[:match_at], True
        hold = self._held_length(buffer)
        self._buffer = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The held-back text, once the stream ended without a match."""
        text, self._buffer = self._buffer, ""
        return "" if self.stopped else text

    def _held_length(self, buffer: str) -> int:
        for length in range(min(len(buffer), self._max_hold), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
