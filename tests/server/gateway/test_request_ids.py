"""A crash inside the serving API still answers in the dialect's error shape, with the request id.

The gateway's routes are wrapped as in the app (``RequestIds`` the outermost user middleware,
Starlette's own ServerErrorMiddleware outside it); the handlers raise an exception nothing
handles. Read by the official SDKs, as a client sees it.
"""

from __future__ import annotations

import asyncio
import re

import anthropic
import httpx
import httpx2
import openai
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import StreamingResponse
from starlette.routing import Route

from server.gateway.app import RequestIds

GENERATED_ID = re.compile(r"req_[0-9a-f]{24}")


class Boom(RuntimeError):
    pass


async def crash(request):
    raise Boom("a bug")


async def crash_mid_stream(request):
    async def body():
        yield b"data: one\n\n"
        raise Boom("a bug after the first frame")

    return StreamingResponse(body(), media_type="text/event-stream")


def app() -> Starlette:
    routes = [Route("/v1/chat/completions", crash, methods=["POST"]), Route("/v1/messages", crash, methods=["POST"]),
              Route("/v1/stream", crash_mid_stream, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(RequestIds)])


def http(library=httpx):
    """An HTTP client of ``library`` (the Anthropic SDK brings its own fork, ``httpx2``) on the app."""
    return library.AsyncClient(transport=library.ASGITransport(app(), raise_app_exceptions=False),
                               base_url="http://gateway")


def test_an_unhandled_crash_answers_500_in_the_openai_shape_with_the_request_id() -> None:
    async def go() -> openai.InternalServerError:
        api = openai.AsyncOpenAI(api_key="k", base_url="http://gateway/v1", http_client=http(), max_retries=0)
        try:
            await api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              extra_headers={"x-client-request-id": "mine-1"})
        except openai.InternalServerError as exc:
            return exc
        raise AssertionError("no error")

    error = asyncio.run(go())
    assert error.status_code == 500 and GENERATED_ID.fullmatch(error.request_id or ""), error.response.headers
    assert error.body["code"] == "internal_error" and error.body["type"] == "server_error"
    assert error.request_id in error.body["message"]  # a person can quote it
    assert error.response.headers["x-client-request-id"] == "mine-1"
    assert "a bug" not in error.response.text  # the exception's text stays in the server's log


def test_an_unhandled_crash_under_messages_answers_in_the_anthropic_shape() -> None:
    async def go() -> anthropic.InternalServerError:
        api = anthropic.AsyncAnthropic(api_key="k", base_url="http://gateway", http_client=http(httpx2), max_retries=0)
        try:
            await api.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        except anthropic.InternalServerError as exc:
            return exc
        raise AssertionError("no error")

    error = asyncio.run(go())
    assert error.status_code == 500 and GENERATED_ID.fullmatch(error.request_id or ""), error.response.headers
    assert error.body["type"] == "error" and error.body["error"]["type"] == "api_error"
    assert error.request_id in error.body["error"]["message"]


def test_a_crash_after_the_answer_started_adds_nothing_to_it() -> None:
    async def go() -> httpx.Response:
        async with http() as client:
            return await client.post("/v1/stream")

    response = asyncio.run(go())
    assert response.status_code == 200 and GENERATED_ID.fullmatch(response.headers["x-request-id"])
    assert response.content == b"data: one\n\n"  # no error body appended to a stream already under way
