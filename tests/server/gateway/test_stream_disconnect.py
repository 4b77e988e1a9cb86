"""A client that leaves a streamed request before its body starts leaks nothing.

The window: the gateway holds the engine's first chunk, an open engine stream and the
tenant's admission slot when it returns the streaming response (``completions.PrimedChunks``);
a client that disconnected while the first token was awaited makes Starlette cancel the
body task before the body generator ever starts, so the generator's ``finally`` (release
the slot, close the engine stream) would never run. Real engine, real gateway over HTTP,
a raw socket client that sends a streamed request and closes the connection while the
engine holds it (fault knob ``fault_first_token_hold_ms``), more times than the tenant's
concurrency limit.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.server.gateway.fleet import MODEL, start_fleet

LIMIT = 2  # the tenant's max_concurrent_requests
HOLD_MS = 800  # the engine holds each new request this long: the client leaves meanwhile


class Asgi24:
    """Serves the gateway as an ASGI spec 2.4 server would (uvicorn speaks 2.3): sending to a
    client that is gone raises ``OSError``. Starlette then raises ``ClientDisconnect`` from
    the headers' send, before its first ``anext`` of the body. ``on`` switches it."""

    def __init__(self, app) -> None:
        self.app = app
        self.on = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.on:
            return await self.app(scope, receive, send)
        cycle = send.__self__  # uvicorn's RequestResponseCycle: it knows whether the client left
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}

        async def checked(message):
            if cycle.disconnected:
                raise OSError("client disconnected")
            await send(message)
        await self.app(scope, receive, checked)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundle):
    built = start_fleet(tmp_path_factory.mktemp("disconnect"), bundle, replicas_count=1,
                        settings={"first_token_timeout_s": 30.0}, wrap=Asgi24)
    built.add_tenant("gone", max_concurrent_requests=LIMIT)
    yield built
    built.close()


def admitted(fleet, slug: str) -> int:
    """The tenant's admission slots in use (the gateway's LocalAdmission)."""
    return asyncio.run(fleet.gateways[0].app.state.gateway.admission.in_flight(slug))


def send_and_leave(fleet, slug: str, max_tokens: int) -> None:
    """POST a streamed chat request on a raw socket; close it once the engine holds it."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}).encode()
    port = fleet.gateways[0].port
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {fleet.keys[slug]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        # the gateway has read the body, admitted the request and dispatched it: it now waits
        # for the first token (prime), with nothing sent to the client yet
        fleet.wait_until(lambda: fleet.engine_in_flight("r0") == 1, timeout=30, what="engine holds the request")
        assert admitted(fleet, slug) >= 1
    # closed: the gateway learns of the disconnect before its response starts


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_clients_leaving_before_the_stream_starts_release_their_slot_and_the_engine_request(fleet, spec):
    fleet.gateways[0].asgi.on = spec == "2.4"
    gone_before = fleet.metric("kvgate_requests_total", tenant="gone", status="client_gone")
    fleet.hang("r0", HOLD_MS)
    try:
        for _ in range(LIMIT + 2):
            send_and_leave(fleet, "gone", max_tokens=150)
            # the held request is released to the engine, the gateway primes its first chunk,
            # returns the stream to a client that is gone: everything must be let go
            fleet.wait_until(lambda: admitted(fleet, "gone") == 0, timeout=20, what="admission slot released")
            fleet.wait_until(lambda: fleet.engine_in_flight("r0") == 0, timeout=20, what="engine request cancelled")
            replica = fleet.replica("r0")
            fleet.wait_until(lambda: replica.in_flight == 0, timeout=5, what="router load released")
    finally:
        fleet.hang("r0", 0)
    response = fleet.chat("gone", [{"role": "user", "content": "Say hi."}], max_tokens=2, stream=True)
    assert response.status_code == 200, response.text
    assert "data: [DONE]" in response.text
    assert admitted(fleet, "gone") == 0
    assert fleet.metric("kvgate_requests_total", tenant="gone", status="client_gone") == gone_before + LIMIT + 2
