"""Stop strings over streamed text: cut where the first one completes, never leak part of one.

Text that could be the beginning of a stop string is held back until the next text shows
whether it is one. A stop string therefore never starts inside text already emitted, so the
search only needs the held-back text.
"""

from __future__ import annotations


class StopMatcher:
    """Filters one choice's text; `matched` is set once a stop string has been seen."""

    def __init__(self, stop_strings: list[str]) -> None:
        self._stop_strings = [stop for stop in stop_strings if stop]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of the text so far that is safe to emit; "" after a match."""
        if self.matched is not None:
            return ""
        self._held += text
        match_start = self._first_match()
        if match_start is not None:
            safe, self._held = self._held[:match_start], ""
            return safe
        keep = self._longest_partial_match()
        safe = self._held[: len(self._held) - keep]
        self._held = self._held[len(safe) :]
        return safe

    def flush(self) -> str:
        """The held-back text, at the end of a choice that did not match."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_match(self) -> int | None:
        """Start of the stop string that completes first (as if the text came one character at a time)."""
        found = []
        for stop in self._stop_strings:
            start = self._held.find(stop)
            if start >= 0:
                found.append((start + len(stop), start, stop))
        if not found:
            return None
        _, start, self.matched = min(found)
        return start

    def _longest_partial_match(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if stop.startswith(self._held[-length:]):
                    longest = length
                    break
        return longest
