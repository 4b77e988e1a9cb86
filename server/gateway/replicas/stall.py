"""An answer's engine going silent mid-way: the inter-token deadline and what it raises.

:class:`StallWatch` is one attempt's deadline between the engine's messages (one lazily re-armed
timer per stream, not one per token); :class:`EngineStalled` is what the router raises when it
fires (the call cancelled, the engine freed the request); :class:`EngineRestart` asks a consumer
that kept every chunk to itself (a non-streamed answer the engine streams) to run the request
again on another replica, the failed attempt's output dropped.
"""

from __future__ import annotations

import asyncio

from server.gateway.replicas.engine_client import EngineTimeout, EngineUnavailable

__all__ = ["EngineRestart", "EngineStalled", "StallWatch"]


class EngineStalled(EngineTimeout):
    """The replica serving an answer sent nothing for the inter-token deadline after its first
    message; the router has cancelled the call (the engine freed the request)."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


class EngineRestart(EngineUnavailable):
    """A restartable attempt (:meth:`RoutedEngine.generate`) failed after its first message and
    another replica can take the request: call ``generate`` again on the same
    :class:`RoutedEngine` (the failed replica excluded, the retry counted), after dropping
    what the failed attempt produced. A consumer that does not restart treats it as what it
    is, an :class:`EngineUnavailable`."""


class StallWatch:
    """The inter-token deadline of one attempt: cancels the task awaiting the attempt's next
    message once it has waited ``limit`` seconds (:meth:`expired` then tells the cancel apart).

    Why not ``asyncio.timeout`` around each message: that schedules and cancels a timer per
    token (~10 µs each, measured); this keeps one timer per ``limit`` seconds of streaming,
    re-armed lazily from the time the current wait began (a clock read per message). Only
    the wait for the engine counts, never the consumer's time between messages."""

    __slots__ = ("_loop", "_limit", "_task", "_since", "_handle", "_cancelling", "_fired")

    def __init__(self, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._task: asyncio.Task | None = None
        self._since: float | None = None  # when the current wait began; None between waits
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._fired = False

    def waiting(self) -> None:
        """The current task is about to await the next message."""
        self._since = now = self._loop.time()
        self._task = asyncio.current_task()
        if self._handle is None:
            self._handle = self._loop.call_at(now + self._limit, self._check)

    def got(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None or self._task is None:
            return  # not waiting now: the next wait re-arms
        due = since + self._limit
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        if self._task.cancelling():  # a cancel is already on its way (the client gone, a shutdown): it ends the wait
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    def expired(self) -> bool:
        """Called on ``CancelledError`` from the wait: True when this watch's cancel caused it
        (the cancel is then withdrawn); a cancel from elsewhere stays a cancel."""
        return self._fired and self._task is not None and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._since = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
