"""Graceful drain on SIGTERM: finish what is in flight, refuse what is new, then exit.

uvicorn's own shutdown closes the listening socket at once, so a request arriving
during a rolling restart gets "connection refused" instead of an answer it can act on.
kvgate drains in two steps instead:

1. the first SIGTERM (or SIGINT) sets ``GatewayServices.draining``: the listener stays
   open, new serving requests get 503 ``shutting_down`` with ``Retry-After`` and
   ``Connection: close``, ``/readyz`` turns 503 (load balancers stop routing here), and
   requests already in flight (streams included) run to their end;
2. when no serving request is in flight, uvicorn's normal shutdown runs (lifespan shutdown
   flushes usage and closes engine channels). After ``drain_timeout`` seconds the engine
   calls still running are ended first (``GatewayServices.abort_in_flight``): each of those
   requests answers 503 ``shutting_down`` with ``Retry-After``, or its stream ends with the
   dialect's error event, with its usage and admission settled; the shutdown runs once they
   have answered, or ``abort_grace`` seconds later. (Left to uvicorn, a request still running
   is cancelled: a plain-text 500, or a stream cut with no error event.)

A second signal during the drain ends what still runs at once, as the timeout would; a
third skips waiting for those answers (uvicorn's immediate shutdown). The process then
exits 0, so ``kvgate serve`` stops its engine child on the way out.

Invariant: :class:`InFlight` counts a serving request from its first ASGI call until
its response has been sent completely (for a stream: after the last SSE frame), so
``in_flight == 0`` means no client is waiting for bytes from this process.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from server.gateway.services import GatewayServices

log = logging.getLogger("kvgate.gateway")

SERVING_PREFIX = "/v1/"


class InFlight:
    """ASGI middleware: counts serving requests in ``services.in_flight``."""

    def __init__(self, app, services: GatewayServices) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(SERVING_PREFIX):
            return await self.app(scope, receive, send)
        self.services.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.services.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains ``services`` before shutting down."""

    def __init__(self, config: uvicorn.Config, services: GatewayServices, *, drain_timeout: float = 30.0,
                 abort_grace: float = 5.0) -> None:
        super().__init__(config)
        self.services = services
        self.drain_timeout = drain_timeout
        self.abort_grace = abort_grace  # after aborting what still runs: how long its answers may take
        self._drain_started: float | None = None
        self._aborted_at: float | None = None
        self._cut_short = False  # a second signal: the timeout is reached now

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Why not uvicorn's handle_exit: it records the signal and re-raises it once the
        # server has stopped, which kills the process before `kvgate serve` can stop its
        # engine child. A drained gateway returns normally and exits 0.
        if self._drain_started is None and not self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            # Only flags here: this runs as a signal handler between two bytecodes of the
            # event loop thread; the loop's next tick (on_tick, every 0.1 s) does the rest.
            self._drain_started = time.monotonic()
            self.services.draining = True
            return
        if self._drain_started is not None and not self.should_exit and not self._cut_short and self._aborted_at is None:
            self._cut_short = True  # second signal: end what still runs now, as the timeout would
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # fourth Ctrl-C: do not wait for connections either
        else:
            self.should_exit = True  # third signal: stop waiting for the answers

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self._drain_started
            if self.services.in_flight <= 0:
                log.warning("drained after %.1f s; shutting down", waited)
                self.should_exit = True
            elif self._aborted_at is None and (waited >= self.drain_timeout or self._cut_short):
                self._aborted_at = time.monotonic()
                calls = self.services.abort_in_flight()
                log.warning("%s with %d requests in flight; ending their %d engine calls (503 shutting_down), "
                            "then shutting down", "second signal" if self._cut_short else
                            f"drain timeout ({self.drain_timeout:.0f} s)", self.services.in_flight, calls)
            elif self._aborted_at is not None and time.monotonic() - self._aborted_at >= self.abort_grace:
                log.warning("%d requests still in flight %.0f s after their engine calls were ended; shutting down",
                            self.services.in_flight, self.abort_grace)
                self.should_exit = True
        return await super().on_tick(counter)
