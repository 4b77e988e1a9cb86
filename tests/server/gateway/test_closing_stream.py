"""``ClosingStreamingResponse``: its cleanup runs however Starlette's sending ends, including
when the body generator never starts (a client gone before the headers went out)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from server.gateway.api.completions import ClosingStreamingResponse


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
