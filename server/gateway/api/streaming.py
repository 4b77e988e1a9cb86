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
* frames the body produces without waiting go out together, in one ``http.response.body``
  message (same bytes, in order); whatever is held is sent before the body waits for
  anything, so no frame is ever delayed to wait for the next one (:func:`_next_frame`).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Generator

import anyio
from fastapi.responses import StreamingResponse


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
    """

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def stream_response(self, send) -> None:
        """Starlette's, except that a :class:`LastFrame` goes out as the body's last message
        (with HTTP/1.1 chunked encoding, the frame and the terminating chunk in one write),
        and that frames ready together go out together (:func:`_next_frame`): a streamed
        answer whose engine messages arrived at once costs one ``send`` (one socket write)
        instead of one per token."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        held: list[bytes] = []

        def flush() -> Awaitable[None]:
            body = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            return send({"type": "http.response.body", "body": body, "more_body": True})

        body_iterator = self.body_iterator
        ended = False
        while True:  # to its end: the body's own finally runs in it
            try:
                chunk = await _next_frame(body_iterator, flush if held else None)
            except StopAsyncIteration:
                break
            except BaseException:
                if held:  # the body failed right after these frames: they still go out first, as before
                    await flush()
                raise
            held.append(chunk)
            if type(chunk) is LastFrame:
                ended = True
                await send({"type": "http.response.body", "body": b"".join(held), "more_body": False})
                held.clear()
        if not ended:
            await send({"type": "http.response.body", "body": b"".join(held), "more_body": False})

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


@types.coroutine
def _next_frame(body: AsyncIterator[bytes], flush: Callable[[], Awaitable[None]] | None) -> Generator:
    """The body's next frame; if the body has to wait for it, ``flush()`` (the frames held so
    far) is sent first, then the body is resumed. Raises ``StopAsyncIteration`` at its end.

    How "has to wait" is known: the body's ``__anext__`` is stepped by hand once; a frame it
    produces without suspending comes back at once (``StopIteration``), otherwise the step
    handed up what it waits on (a future), which is passed on to the task after the flush,
    exactly as ``await`` would have (every later value sent or exception thrown in goes to
    the step). A flush that fails (the client gone, a cancel) leaves a step half run, which
    would keep the body generator "already running" for ever (its ``aclose`` then raises):
    the step is ended first, by throwing ``GeneratorExit`` into it as ``aclose`` would at a
    ``yield`` (its cleanup may still await: it is driven to its end), and the flush's error
    propagates.
    """
    step = body.__anext__()
    try:
        signal = step.send(None)
    except StopIteration as ready:
        return ready.value
    if flush is not None:
        try:
            yield from flush().__await__()
        except BaseException:
            try:
                yield from _drive(step, None, GeneratorExit())
            except BaseException:  # noqa: BLE001 - the body's end; the flush's error is the one to raise
                pass
            raise
    return (yield from _drive(step, signal, None))


@types.coroutine
def _drive(step, signal, throw: BaseException | None) -> Generator:
    """Run ``step`` to its end as ``await`` does, from its pending ``signal`` (or by throwing ``throw`` into it)."""
    try:
        if throw is not None:
            signal = step.throw(throw)
        while True:
            try:
                sent = yield signal
            except BaseException as exc:  # thrown in by the task (a cancel): the step's to handle
                signal = step.throw(exc)
            else:
                signal = step.send(sent)
    except StopIteration as done:
        return done.value


class LastFrame(bytes):
    """The stream body's last bytes; nothing follows them (:meth:`ClosingStreamingResponse.stream_response`)."""

    __slots__ = ()
