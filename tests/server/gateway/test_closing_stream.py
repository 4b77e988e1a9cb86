"""``ClosingStreamingResponse``: its cleanup runs however Starlette's sending ends, including
when the body generator never starts (a client gone before the headers went out)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from server.gateway.api.completions import ClosingStreamingResponse, LastFrame, run_once_shielded


class Body:
    """A body generator that records whether it started and whether its finally ran."""

    def __init__(self) -> None:
        self.started = self.finalized = False
        self.closed = 0

    async def frames(self):
        self.started = True
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(3600)  # a long stream
            yield b"data: 2\n\n"
        finally:
            self.finalized = True

    async def on_close(self) -> None:
        self.closed += 1


def scope(spec: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "method": "POST", "path": "/"}


async def gone_send_24(message) -> None:
    raise OSError("client gone")  # what an ASGI 2.4 server does once the client has left


async def disconnected() -> dict:
    return {"type": "http.disconnect"}


def test_a_body_that_never_starts_is_still_cleaned_up_under_asgi_2_4() -> None:
    body = Body()
    response = ClosingStreamingResponse(body.frames(), on_close=body.on_close)
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope("2.4"), disconnected, gone_send_24))
    assert not body.started and body.closed == 1


def test_starlettes_own_response_never_starts_that_body() -> None:
    """Why the subclass exists: with the installed Starlette nothing would release the slot.
    (If this fails, Starlette changed; the subclass stays correct either way.)"""
    body = Body()
    response = StreamingResponse(body.frames())
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope("2.4"), disconnected, gone_send_24))
    assert not body.started and not body.finalized


def test_a_disconnect_mid_stream_runs_the_bodys_finally_then_the_cleanup_once() -> None:
    body = Body()
    response = ClosingStreamingResponse(body.frames(), on_close=body.on_close)
    sent: list[dict] = []

    async def main() -> None:
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                gone.set()  # the client leaves after the first frame

        await response(scope("2.3"), receive, send)

    asyncio.run(main())
    assert body.started and body.finalized and body.closed == 1
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_a_complete_stream_is_cleaned_up_once() -> None:
    calls = []

    async def frames():
        try:
            yield b"a"
        finally:
            calls.append("finally")

    async def on_close() -> None:
        calls.append("on_close")

    async def main() -> None:
        never = asyncio.Event()

        async def receive() -> dict:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            pass

        await ClosingStreamingResponse(frames(), on_close=on_close)(scope("2.3"), receive, send)

    asyncio.run(main())
    assert calls == ["finally", "on_close"]


@pytest.mark.parametrize("last", [True, False])
def test_a_last_frame_ends_the_body_in_its_own_message(last) -> None:
    """A body ending with :class:`LastFrame` needs no empty closing message (one socket
    write less); the body still runs to its end (its ``finally``) before the cleanup."""
    calls = []

    async def frames():
        try:
            yield b"data: 1\n\n"
            yield LastFrame(b"data: [DONE]\n\n") if last else b"data: [DONE]\n\n"
        finally:
            calls.append("finally")

    async def on_close() -> None:
        calls.append("on_close")

    sent: list[dict] = []

    async def main() -> None:
        never = asyncio.Event()

        async def receive() -> dict:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            sent.append(message)

        await ClosingStreamingResponse(frames(), on_close=on_close)(scope("2.3"), receive, send)

    asyncio.run(main())
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    if last:
        assert bodies == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    else:
        assert bodies == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", True), (b"", False)]
    assert calls == ["finally", "on_close"]


def test_a_cleanup_started_by_a_cancelled_body_runs_to_its_end_and_only_once() -> None:
    """The body's ``finally`` is the first caller when the client leaves right after the last
    frame: Starlette cancels the task group that runs the body (an anyio cancel scope, which
    re-delivers the cancellation at every ``await``), yet the slot release, metrics and trace
    line after the cleanup's first ``await`` must all happen, and the response's later call
    must not repeat them."""
    steps: list[str] = []

    async def cleanup() -> None:
        steps.append("release slot")
        await anyio.sleep(0.05)  # e.g. the admission lock or a Redis round trip
        steps.append("metrics and trace line")

    async def main() -> None:
        end = run_once_shielded(cleanup)

        async def body() -> None:
            try:
                await anyio.sleep(3600)
            finally:
                await end()

        async with anyio.create_task_group() as group:
            group.start_soon(body)
            await anyio.sleep(0.01)
            group.cancel_scope.cancel()  # as Starlette does when the client disconnects
        await end()  # the response's finally

    anyio.run(main)
    assert steps == ["release slot", "metrics and trace line"]


def test_without_the_shield_the_cleanup_would_stop_at_its_first_await() -> None:
    """The failure the shield prevents, shown with the same cancellation (a control)."""
    steps: list[str] = []

    async def main() -> None:
        async def body() -> None:
            try:
                await anyio.sleep(3600)
            finally:
                steps.append("release slot")
                await anyio.sleep(0.05)
                steps.append("metrics and trace line")

        async with anyio.create_task_group() as group:
            group.start_soon(body)
            await anyio.sleep(0.01)
            group.cancel_scope.cancel()

    anyio.run(main)
    assert steps == ["release slot"]


def test_a_disconnect_during_the_shielded_cleanup_lets_it_finish_and_the_response_ends_normally() -> None:
    """ASGI 2.3: the client leaves while the body's ``finally`` runs the shielded cleanup (the
    slot release waiting for the usage journal); the cleanup runs to its end, once, and the
    response returns without an error, as with Starlette's collapsing task group."""
    steps: list[str] = []

    async def main() -> None:
        gone = asyncio.Event()

        async def cleanup() -> None:
            steps.append("release slot")
            gone.set()  # the client leaves now
            await asyncio.sleep(0.05)  # e.g. the usage journal's fsync
            steps.append("usage durable")

        end = run_once_shielded(cleanup)

        async def frames():
            try:
                yield b"data: 1\n\n"
                await end()
                yield LastFrame(b"data: [DONE]\n\n")
            finally:
                await end()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            pass

        await ClosingStreamingResponse(frames(), on_close=end)(scope("2.3"), receive, send)
        steps.append("returned")

    asyncio.run(main())
    assert steps == ["release slot", "usage durable", "returned"]


def test_the_listener_waking_at_the_end_of_a_complete_stream_cancels_nothing() -> None:
    """uvicorn wakes a pending ``receive`` with ``http.disconnect`` once the response is
    complete: that must not cancel the cleanup that follows (it awaits), nor leave a task."""
    steps: list[str] = []

    async def main() -> None:
        complete = asyncio.Event()

        async def frames():
            yield LastFrame(b"data: [DONE]\n\n")

        async def on_close() -> None:
            await asyncio.sleep(0.02)
            steps.append("on_close done")

        async def receive() -> dict:
            await complete.wait()
            return {"type": "http.disconnect"}

        async def send(message) -> None:
            if not message.get("more_body", True):
                complete.set()

        before = len(asyncio.all_tasks())
        await ClosingStreamingResponse(frames(), on_close=on_close)(scope("2.3"), receive, send)
        await asyncio.sleep(0)  # the listener's cancellation lands
        steps.append(f"tasks left {len(asyncio.all_tasks()) - before}")

    asyncio.run(main())
    assert steps == ["on_close done", "tasks left 0"]
