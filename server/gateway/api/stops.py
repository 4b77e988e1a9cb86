"""Stop strings over incremental text: what may be emitted while a stop string could still begin.

Invariant: :meth:`StopMatcher.push` never emits a character that a later push could show to
be the start of a stop string; once a stop string is found nothing more is emitted, and
``matched`` names it (the Messages API's ``stop_sequence``).
"""

from __future__ import annotations


class StopMatcher:
    """Incremental text with stop strings: emits only text that cannot start a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found, once stopped

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buffer += text
        if self._stops:
            cut, stop = min(((i, s) for s in self._stops if (i := self._buffer.find(s)) >= 0), default=(-1, None))
            if cut >= 0:
                self.stopped = True
                self.matched = stop
                out, self._buffer = self._buffer[:cut], ""
                return out
        if len(self._buffer) <= self._hold:
            return ""
        emit_upto = len(self._buffer) - self._hold
        out, self._buffer = self._buffer[:emit_upto], self._buffer[emit_upto:]
        return out

    def flush(self) -> str:
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
