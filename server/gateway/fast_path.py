"""The hot routes' fast path: ``POST /v1/chat/completions`` and ``/v1/completions`` without
FastAPI's routing and dependency machinery.

Why: per request, Starlette's router matching, FastAPI's request handler (``Request``
object, dependency solving for ``Header``/``Depends``, the exit stacks, the exception
wrappers around ``send``) cost the gateway more CPU than any kvgate frame of the hot path
(profile in docs/benchmarks.md, ``bench:gateway_profile``). This ASGI middleware answers
the common case itself, with the same handlers (``server.gateway.routes``), the same
dependency functions and the same exception handlers, and hands everything else to the
app unchanged.

Invariants:

* only a request FastAPI would treat exactly as this path does is answered here: an HTTP
  ``POST`` to one of the two paths (no ``root_path``), with a non-empty body whose first
  ``content-type`` is ``application/json``, that ``strict_json.loads`` to an object which the
  route's body model validates (``model_validate(..., from_attributes=True)``, as FastAPI's
  ``ModelField.validate`` does). Anything else (another method, content type, invalid JSON,
  a body the model refuses, a client gone while sending the body) goes to the app with its
  body messages replayed as received, so errors keep their exact shape and precedence;
* the steps keep FastAPI's order: body first, then ``current_tenant`` (draining check,
  then authentication), then the handler; an exception from the dependency or the
  handler goes to the app's own exception handler for its class (``ServingError``,
  ``HTTPException``, ``RequestValidationError``), anything else propagates to the
  server-error middleware as before;
* it sits inside the app's user middleware stack (``install_gateway`` adds it innermost),
  so the in-flight count, the body-size limit and the server-error middleware still wrap
  every request it answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import Request

from server.gateway.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from server.gateway.routes import chat_completions, completions, current_tenant
from server.gateway import strict_json
from server.gateway.services import GatewayServices

Handler = Callable[[BaseModel, object, GatewayServices], Awaitable[object]]
HOT_ROUTES: dict[str, tuple[type[BaseModel], Handler]] = {
    "/v1/chat/completions": (ChatCompletionRequest, chat_completions),
    "/v1/completions": (CompletionRequest, completions),
}


def _json_content_type(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the first ``content-type`` header is ``application/json`` (parameters allowed)."""
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first ``authorization`` header, decoded as Starlette's ``Headers`` decodes it."""
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class HotRoutes:
    """ASGI middleware answering the hot routes' common case; see the module invariants."""

    def __init__(self, app, services: GatewayServices,
                 exception_handlers: dict[type[BaseException], Callable]) -> None:
        self.app = app
        self.services = services
        self.exception_handlers = exception_handlers

    async def __call__(self, scope, receive, send):
        route = HOT_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST" or scope.get("root_path"):
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        messages = []
        while True:  # the whole body, keeping the messages for a replay
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = None
        if messages[-1]["type"] == "http.request" and _json_content_type(headers):
            raw = b"".join(m.get("body", b"") for m in messages)
            body = self._parse(raw, route[0]) if raw else None
        if body is None:
            return await self.app(scope, _replay(messages, receive), send)
        handler = route[1]
        try:
            tenant = await current_tenant(self.services, _authorization(headers))
            response = await handler(body, tenant, self.services)
        except Exception as exc:  # noqa: BLE001 - the app's handler for its class, else re-raised
            on_error = self._handler_for(exc)
            if on_error is None:
                raise
            response = await on_error(Request(scope, receive), exc)
        await response(scope, receive, send)

    @staticmethod
    def _parse(raw: bytes, model: type[BaseModel]) -> BaseModel | None:
        # Any failure (not JSON, too deep, refused by the model) is FastAPI's to render.
        try:
            data = strict_json.loads(raw)
            if not isinstance(data, dict):
                return None
            return model.model_validate(data, from_attributes=True)
        except Exception:  # noqa: BLE001
            return None

    def _handler_for(self, exc: Exception) -> Callable | None:
        for cls in type(exc).__mro__:  # as Starlette's lookup: the most specific class first
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                return handler
        return None


def _replay(messages: list[dict], receive):
    """``receive`` that first returns ``messages`` (already read), then reads on."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
