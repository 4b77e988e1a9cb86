"""The Anthropic Messages dialect's rendering: message objects, stream events, errors, usage.

A :class:`~server.gateway.api.completions.Dialect` over the one request core. The neutral
outcome maps as::

    finish "tool_calls"            → stop_reason "tool_use"
    finish "length"                → "max_tokens"
    finish "stop" + stop string    → "stop_sequence" (stop_sequence: the string)
    finish "stop"                  → "end_turn"

**Usage** splits the prompt in three parts that add up to it (Anthropic's accounting; computed by
``completions.cache_usage``, which the usage ledger bills too)::

    cache_read_input_tokens      tokens served from KV: reused blocks × tokens per block
                                 (what the OpenAI path reports as cached_tokens)
    cache_creation_input_tokens  tokens the gateway kept under a hint (``Outcome.hinted``: the
                                 full blocks the class and the hint budget let a breakpoint
                                 cover) not read from KV, split by the TTL they were kept for
                                 (the client's, capped by the class: 1 h or more → 1h, shorter
                                 → 5m) into cache_creation.ephemeral_5m / ephemeral_1h_input_tokens;
                                 0 when the gateway ignored the hints (a class without hints,
                                 an over-quota tenant, no room in the hint budget)
    input_tokens                 the rest

**Stream** (``event: <type>`` + ``data: <json>``): ``message_start`` (usage with the input
split, known once the engine's first response is in), ``ping`` (again every ~10 s while a tool call's
text is held back: ``streaming.KEEP_ALIVE``), for the text a
``content_block_start`` / ``text_delta`` per delta / ``content_block_stop``, then per tool
call a ``tool_use`` block with its input as one ``input_json_delta`` (calls are parsed at the
end, as on the OpenAI path), ``message_delta`` (stop_reason, the final usage), ``message_stop``.
An engine failure mid-stream is an ``error`` event, then the stream ends.

**Errors** have Anthropic's shape and statuses: ``{"type": "error", "error": {"type", "message"},
"request_id": "req_..."}``, the stream's ``error`` event too; the gateway's 503 (engine or gateway
unavailable) is Anthropic's 529 ``overloaded_error``. ``request_id`` is
:data:`~server.gateway.context.REQUEST_ID`, the id the answer's ``request-id`` header carries
(``server.gateway.app.RequestIds`` sets both); it is left out only outside a request (tests).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from server.gateway.api.completions import CompletionJob, Outcome, cache_usage
from server.gateway.context import REQUEST_ID
from server.gateway.errors import ServingError

# gateway status -> (Anthropic status, error type); anything else keeps its status as api_error
_ERRORS = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
           403: (403, "permission_error"), 404: (404, "not_found_error"), 405: (405, "invalid_request_error"),
           413: (413, "request_too_large"), 422: (400, "invalid_request_error"), 429: (429, "rate_limit_error"),
           500: (500, "api_error"), 502: (500, "api_error"), 503: (529, "overloaded_error"),
           504: (504, "timeout_error")}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def error_status(exc: ServingError) -> tuple[int, str]:
    return _ERRORS.get(exc.status, (exc.status if exc.status >= 400 else 500, "api_error"))


def error_body(exc: ServingError) -> dict:
    body: dict = {"type": "error", "error": {"type": error_status(exc)[1], "message": exc.message}}
    request_id = REQUEST_ID.get()
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(exc: ServingError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=error_status(exc)[0], headers=exc.headers)


def usage(job: CompletionJob, outcome: Outcome) -> dict:
    total = job.prompt.total
    # a stream's message_start comes before the first delta: the first response's metrics say it (cache_usage);
    # the same split the usage ledger bills
    read, five, hour = cache_usage(job, outcome)
    return {"input_tokens": total - read - five - hour, "cache_creation_input_tokens": five + hour,
            "cache_read_input_tokens": read, "output_tokens": outcome.completion_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": five, "ephemeral_1h_input_tokens": hour}}


def stop_reason(outcome: Outcome) -> str:
    if outcome.stop_sequence is not None and not outcome.tool_calls:
        return "stop_sequence"
    return _STOP_REASONS.get(outcome.finish_reason or "stop", "end_turn")


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _event(kind: str, payload: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_json_str = json.encoder.encode_basestring_ascii  # json.dumps(str) == _json_str(str) (ensure_ascii)
_PING = _event("ping", {"type": "ping"})


class MessagesDialect:
    """Renders ``/v1/messages`` answers (stateless)."""

    __slots__ = ()
    keeps_alive = True  # a KEEP_ALIVE delta is a ping event (streaming.KEEP_ALIVE)

    def body(self, job: CompletionJob, outcome: Outcome) -> dict:
        content: list[dict] = []
        if outcome.text:
            content.append({"type": "text", "text": outcome.text})
        for call in outcome.tool_calls:
            content.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.name,
                            "input": json.loads(call.arguments)})
        reason = stop_reason(outcome)
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": job.model,
                "content": content, "stop_reason": reason,
                "stop_sequence": outcome.stop_sequence if reason == "stop_sequence" else None,
                "usage": usage(job, outcome)}

    async def stream(self, job: CompletionJob, outcome: Outcome, deltas: AsyncIterator[str]) -> AsyncIterator[bytes]:
        message = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": job.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(job, outcome)}
        yield _event("message_start", {"type": "message_start", "message": message}) + _PING
        # Why: one event per token is the hot path; only the text changes (as on the OpenAI path).
        head, tail = _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": "\x00"}}).split(b'"\\u0000"')
        index = 0
        try:
            async for delta in deltas:
                if not delta:  # KEEP_ALIVE: a tool call's text is held back; a ping keeps proxies from timing out
                    yield _PING
                    continue
                if index == 0:
                    index = 1
                    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                         "content_block": {"type": "text", "text": ""}})
                yield head + _json_str(delta).encode() + tail
        except ServingError as err:  # the engine failed mid-stream
            yield _event("error", error_body(err))
            return
        closing = b""
        if index == 1:
            closing += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        for call in outcome.tool_calls:
            closing += _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}})
            closing += _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                      "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
            closing += _event("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        reason = stop_reason(outcome)
        closing += _event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": outcome.stop_sequence if reason == "stop_sequence" else None},
            "usage": usage(job, outcome)})
        yield closing + _event("message_stop", {"type": "message_stop"})


MESSAGES = MessagesDialect()
