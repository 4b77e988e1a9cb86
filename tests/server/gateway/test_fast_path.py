"""``HotRoutes``: what it answers itself and what it hands to the app, body replayed as received.

The e2e tests (test_openai_e2e.py and the others over the real stack) check that answers
and errors keep their shape through it; these check the hand-off itself.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.responses import JSONResponse

from server.gateway.errors import ServingError, error_response
from server.gateway.fast_path import HotRoutes

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class InnerApp:
    """The app behind the fast path: records what it was given and answers 299."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    async def __call__(self, scope, receive, send) -> None:
        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        self.calls.append(messages)
        await JSONResponse({"inner": True}, status_code=299)(scope, receive, send)


def run(app, *, path="/v1/chat/completions", method="POST", content_type=b"application/json",
        chunks=(json.dumps(CHAT).encode(),), root_path="") -> tuple[int, dict]:
    headers = [(b"content-type", content_type)] if content_type else []
    scope = {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": headers,
             "query_string": b"", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


async def on_serving_error(request, exc: ServingError):
    return error_response(exc)


def hot(draining: bool = True) -> tuple[HotRoutes, InnerApp]:
    inner = InnerApp()
    # draining: current_tenant refuses before touching anything else of the services
    services = SimpleNamespace(draining=draining)
    return HotRoutes(inner, services, {ServingError: on_serving_error}), inner


def test_a_valid_request_is_answered_without_the_app_and_errors_use_its_handler() -> None:
    app, inner = hot()
    status, body = run(app, chunks=(b'{"model": "m", ', b'"messages": [{"role": "user", "content": "hi"}]}'))
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert inner.calls == []


@pytest.mark.parametrize("kwargs", [
    {"chunks": (b'{"model": "m", "messages": [',)},  # not JSON
    {"chunks": (b"[1, 2]",)},  # JSON, not an object
    {"chunks": (json.dumps({**CHAT, "bogus": 1}).encode(),)},  # refused by the model
    {"chunks": (b"",)},  # empty
    {"content_type": b"text/plain"},
    {"content_type": None},
    {"method": "PUT"},
    {"root_path": "/api"},
    {"path": "/v1/chat/completions/"},
    {"path": "/v1/models"},
])
def test_everything_else_goes_to_the_app_with_the_body_replayed(kwargs) -> None:
    app, inner = hot()
    chunks = kwargs.get("chunks", (json.dumps(CHAT).encode(),))
    status, body = run(app, **kwargs)
    assert status == 299 and body == {"inner": True}
    assert len(inner.calls) == 1
    assert b"".join(m["body"] for m in inner.calls[0]) == b"".join(chunks)
    assert inner.calls[0][-1]["more_body"] is False


def test_a_body_in_several_messages_is_replayed_message_by_message() -> None:
    app, inner = hot()
    chunks = (b'{"model": "m", ', b'"messages": [', b"]")
    run(app, chunks=chunks)
    assert [m["body"] for m in inner.calls[0]] == list(chunks)
