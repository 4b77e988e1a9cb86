"""Ending the engine calls still running when a drain runs out of time, in the API's words.

A SIGTERM drain (``server/gateway/drain.py``) waits for the requests in flight; past its
timeout the server shuts down regardless. Left to uvicorn, that cancels each request's task:
a client whose answer had not started gets a plain-text 500 with neither the dialect's error
shape nor a request id, and a stream is cut with no error event. Instead the drain first calls
:meth:`Aborts.abort_all`: every routed attempt waiting for its engine is cancelled (its engine
call with it, as a client gone would), and the attempt raises :class:`GatewayShuttingDown`,
which the request core answers as any engine failure is answered: 503 ``shutting_down`` with
``Retry-After`` before the answer started, the dialect's error event in a stream, the
request's admission and usage settled on the way out.

The same cancel serves an eviction (:meth:`Attempt.evict`): when a replica's breaker opens
because it is unavailable, its attempts still waiting for their first chunk are cancelled and
raise :class:`ReplicaLost`, which the router retries on another replica at once instead of
letting them wait out their own deadline there (``routing.PoolRoute.mark_failed``).

Invariants: an abort cancels only a task that is waiting for its engine at that moment (the
consumer's own work between messages is never interrupted; an attempt aborted then raises
before its next wait), and a cancel from elsewhere stays a cancel (:meth:`Attempt.caused` tells the
two apart, as ``stall.StallWatch`` does). Once :meth:`Aborts.abort_all` ran, an attempt that
begins is aborted from its start: the shutdown does not wait for requests that start late.
"""

from __future__ import annotations

import asyncio

from server.gateway.replicas.engine_client import EngineUnavailable

__all__ = ["Aborts", "Attempt", "GatewayShuttingDown", "ReplicaLost"]


class GatewayShuttingDown(EngineUnavailable):
    """The gateway is shutting down past its drain timeout: the attempt's engine call was
    cancelled. Never retried on another replica, never counted against the replica."""


class ReplicaLost(EngineUnavailable):
    """The attempt's replica went out of rotation as unavailable (its breaker opened) before the
    attempt's first chunk: its call was cancelled. Retried on another replica; the breaker has
    already counted the failure, so the attempt does not count it again."""


class Attempt:
    """One routed attempt's abort state; ``waiting`` is set while its task awaits the engine.
    ``evicted``: its replica went out of rotation before its first chunk (:meth:`evict`)."""

    __slots__ = ("task", "waiting", "aborted", "evicted", "_fired", "_cancelling")

    def __init__(self, task: asyncio.Task | None, aborted: bool = False) -> None:
        self.task = task
        self.waiting = False
        self.aborted = aborted
        self.evicted = False
        self._fired = False
        self._cancelling = 0

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        self._cancel()

    def evict(self) -> None:
        """Its replica is out of rotation (unavailable) and it has had no chunk yet: stop waiting
        there (the router then retries it elsewhere, or stops before its next wait)."""
        if self.evicted or self.aborted:
            return
        self.evicted = True
        self._cancel()

    def _cancel(self) -> None:
        # A cancel already pending on the task (a client gone, the stall deadline, an eviction) is
        # not ours to claim again: the wait ends with it, and the attempt stops before its next wait.
        if self.waiting and self.task is not None and self.task.cancelling() == 0:
            self._fired = True
            self._cancelling = self.task.cancelling()
            self.task.cancel()

    def caused(self) -> bool:
        """Called on ``CancelledError`` from the wait: True when this abort's cancel caused it
        (the cancel is then withdrawn)."""
        return self._fired and self.task is not None and self.task.uncancel() <= self._cancelling


class Aborts:
    """The routed attempts in progress (one set per gateway), for :meth:`abort_all`."""

    __slots__ = ("_attempts", "closing")

    def __init__(self) -> None:
        self._attempts: set[Attempt] = set()
        self.closing = False

    def begin(self) -> Attempt:
        attempt = Attempt(asyncio.current_task(), aborted=self.closing)
        self._attempts.add(attempt)
        return attempt

    def end(self, attempt: Attempt) -> None:
        self._attempts.discard(attempt)

    def abort_all(self) -> int:
        """Abort every attempt in progress and every later one; returns how many were running."""
        self.closing = True
        running = list(self._attempts)
        for attempt in running:
            attempt.abort()
        return len(running)
