"""The SSE response of the hot path: its cleanup runs exactly once, shielded, however sending ends.

Invariants:

* :class:`ClosingStreamingResponse` calls its ``on_close`` once the body is done, whether
  the body ran to its end, stopped mid-stream (client gone) or never started (client gone
  before the headers went out); ``on_close`` built by :func:`run_once_shielded` runs at most
  once and always to its end, even from a task being cancelled;
* under ASGI spec 2.3 (uvicorn's HTTP/1.1 servers, whose ``send`` returns silently once the
  client is gone) a client's disconnect stops the body at its next unshielded ``await``, as
  Starlette's own response does; the response then ends normally (no exception), as with
  Starlette's collapsing task group;
* a :class:`LastFrame` is the body's last message: nothing is sent after it;
* :class:`UntilDisconnect` cancels the work it encloses when the client disconnects (the
  request's ``receive`` says ``http.disconnect``): the engine call is closed, which cancels it
  on the engine, and a request whose client left is never retried elsewhere. Before a
  response starts, the hot path finds the request's ``receive`` in :data:`CLIENT_RECEIVE`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar

import anyio
from fastapi.responses import StreamingResponse

# The serving request's ASGI ``receive``, for the app's outermost middleware
# (``server.gateway.app.RequestIds``) to set for every ``/v1/`` request: once the body is read
# it only ever says ``http.disconnect``, which the hot path watches for while it waits for the
# engine before its response starts. None (unset): nothing is watched.
CLIENT_RECEIVE: ContextVar[Callable[[], Awaitable[dict]] | None] = ContextVar("kvgate_client_receive", default=None)

# A stream's text deltas are never empty; an empty one is this: "send the dialect's keep-alive now".
# The core yields it (``completions._generate_extended``) only to a dialect whose class says
# ``keeps_alive = True`` (it renders one between its events: Anthropic's ``event: ping``, an SSE
# comment on the OpenAI routes), while the text of a tool call is held back and nothing else goes
# out, at most every KEEP_ALIVE_SECONDS (``CompletionRunner.keep_alive``): under the idle timeouts
# of common proxies (nginx ``proxy_read_timeout`` 60 s, cloud load balancers 60 s).
KEEP_ALIVE = ""
KEEP_ALIVE_SECONDS = 10.0


def run_once_shielded(cleanup: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``cleanup`` at most once, and always to its end.

    Why shielded: the first caller may be a stream body that is being cancelled (the client
    left right after the last frame). Unshielded, the cancellation would stop the cleanup at
    its first ``await`` — the admission slot, the metrics, the usage and the trace line lost —
    and the response's own later call would find it already done."""
    done = False

    async def once() -> None:
        nonlocal done
        if done:
            return
        done = True
        with anyio.CancelScope(shield=True):
            await cleanup()

    return once


async def _until_disconnect(receive) -> None:
    """Starlette's ``listen_for_disconnect``: read until the client is gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


class UntilDisconnect:
    """``with UntilDisconnect(receive) as watch:`` runs its block until the client disconnects,
    then cancels it; the cancel is caught at the block's end and ``watch.gone`` tells.
    ``receive`` None: nothing is watched.

    The cancel is the task's own (``Task.cancel``, told apart from any other as
    ``asyncio.timeout`` does), not an anyio scope's: an anyio scope only catches the
    ``CancelledError`` it sent, and an engine call under it (grpc.aio's unary call) raises
    one of its own on the way out. So the block must hold no cleanup that has to finish (a
    shielded scope does not hold against ``Task.cancel``): the hot path keeps its bookkeeping
    after the block. The listener is one bare asyncio task reading ``receive``; it is
    cancelled when the block ends, so that whoever sends the response next may read
    ``receive`` again."""

    __slots__ = ("_receive", "_task", "_listener", "_finished", "_cancelling", "gone")

    def __init__(self, receive) -> None:
        self._receive = receive
        self._task: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self._finished = False
        self._cancelling = 0
        self.gone = False

    def __enter__(self) -> UntilDisconnect:
        if self._receive is not None:
            self._task = asyncio.current_task()
            self._listener = asyncio.get_running_loop().create_task(_until_disconnect(self._receive))
            self._listener.add_done_callback(self._ended)
        return self

    def _ended(self, listener: asyncio.Task) -> None:
        # Why the flag: a listener that ends (the response's completion also wakes it) after
        # the block is done must not cancel anything.
        if not self._finished and not listener.cancelled() and listener.exception() is None:
            self.gone = True
            self._cancelling = self._task.cancelling()
            self._task.cancel()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._finished = True
        if self._listener is not None:
            self._listener.remove_done_callback(self._ended)
            self._listener.cancel()
        # Ours withdrawn; swallowed unless another cancel is pending too.
        return self.gone and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError


class ClosingStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` whose ``on_close`` runs however sending it ends.

    Why: Starlette (1.10, ``responses.StreamingResponse.__call__``) may end without ever
    iterating the body: under ASGI spec 2.4 an ``OSError`` from sending the headers to a
    client that is gone becomes ``ClientDisconnect`` before the first ``anext``; under 2.3
    the disconnect listener cancels the sending task, which (anyio 4) runs the body only
    because that task had not started yet. A body generator that never started has no
    ``finally`` to run, not even on ``aclose()``, and it holds the admission slot and an
    open engine stream. So the cleanup is a separate, idempotent ``on_close``, called here
    in a ``finally`` (shielded: it must finish even when the task is being cancelled) after
    closing the body iterator, so that a body suspended mid-stream runs its own ``finally``
    first.

    Under ASGI 2.3 the body is sent from the request's own task inside an anyio cancel
    scope, and the disconnect listener is one bare asyncio task whose end cancels that
    scope. Why not Starlette's way (an anyio task group running the sender in a second task
    and the listener in the first): per stream it costs a task, a task group and two wrapper
    coroutines more (~0.1 ms of CPU, docs/benchmarks.md ``bench:gateway_profile``), for the
    same outcome. The scope is anyio's, not ``Task.cancel()``, so a cleanup in a shielded
    scope (:func:`run_once_shielded`) is never interrupted by the disconnect.

    Why each frame is its own ``send``, even when the body made several without waiting:
    coalescing them here was measured (``bench/server/vs_litellm.py``, short prompt,
    production tenant: 1.05–1.09 × less gateway CPU per streamed request at 32 clients, none
    at one client) and withdrawn. To know that the body "would wait", this response has to
    step the body's ``__anext__`` by hand and send the held frames while the body's ``await``
    is pending, inside the body's own cancel scopes: a cancel aimed at the body (a grpclib
    stream error, a call deadline) then lands in the ``send`` and the body's error event and
    last frame are lost, and a failed ``send`` has to throw ``GeneratorExit`` into a shielded
    cleanup, cutting it short. Coalescing belongs where the frames are made, from the engine
    messages already received, not here.
    """

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def stream_response(self, send) -> None:
        """Starlette's, except that a :class:`LastFrame` goes out as the body's last message
        (with HTTP/1.1 chunked encoding, the frame and the terminating chunk in one write)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:  # to its end: the body's own finally runs in it
            ended = type(chunk) is LastFrame
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            spec = scope.get("asgi", {}).get("spec_version", "2.0")
            if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
                await super().__call__(scope, receive, send)
            else:
                await self._send_until_disconnect(receive, send)
                if self.background is not None:
                    await self.background()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()
                finally:
                    await self._on_close()

    async def _send_until_disconnect(self, receive, send) -> None:
        """:meth:`stream_response`, stopped (as Starlette's task group does) when the client leaves."""
        finished = False
        with anyio.CancelScope() as sending:
            def gone(listener: asyncio.Task) -> None:
                # Why the flag: a listener that ends (the response's completion also wakes
                # it) after the body is done must not cancel anything.
                if not finished and not listener.cancelled() and listener.exception() is None:
                    sending.cancel()

            listener = asyncio.get_running_loop().create_task(_until_disconnect(receive))
            listener.add_done_callback(gone)
            try:
                await self.stream_response(send)
            finally:
                finished = True
                listener.remove_done_callback(gone)
                listener.cancel()


class LastFrame(bytes):
    """The stream body's last bytes; nothing follows them (:meth:`ClosingStreamingResponse.stream_response`)."""

    __slots__ = ()
