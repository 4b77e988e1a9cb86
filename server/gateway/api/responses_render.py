"""The OpenAI Responses dialect's rendering: response objects and their stream events.

A :class:`~server.gateway.api.completions.Dialect` over the one request core, one instance
per request (:class:`ResponsesDialect` carries the response's id, its echo of the request
and the store callback). The neutral outcome maps as::

    text                   → a ``message`` output item with one ``output_text`` part (its log
                             probs: its text's tokens, never those of a tool call split off)
    tool calls             → one ``function_call`` output item each (after the message)
    finish "length"        → status "incomplete", incomplete_details.reason "max_output_tokens"
                             (also when the limit cut a tool call: the calls that parsed are listed)
    otherwise              → status "completed", ``completed_at`` (unix seconds; null otherwise)

**Usage**: ``input_tokens`` (the prompt), ``input_tokens_details.cached_tokens`` (reused
blocks × tokens per block, as on the chat path), ``input_tokens_details.cache_write_tokens``
(:func:`written_tokens`: the prompt's full blocks — ``input_tokens // tokens_per_block ×
tokens_per_block``, what the engine keeps of a prompt for reuse — minus ``cached_tokens``,
at least 0; the same ``tokens_per_block``), ``output_tokens``,
``output_tokens_details.reasoning_tokens`` (always 0: the model does not reason). The same
usage goes in the body, the stored response and the ``response.completed`` /
``response.incomplete`` event; a ``response.failed`` event carries the usage billed for
the failed stream (its tokens so far; null when none was generated, as none is billed).

**Stream** (``event: <type>`` + ``data: <json>``, every event with a rising
``sequence_number``): ``response.created``, ``response.in_progress``; for text
``response.output_item.added`` (message), ``response.content_part.added``,
``response.output_text.delta`` per delta (with the log probs of its tokens when asked), ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per tool call (parsed at the
end, as on the other dialects) ``response.output_item.added`` (function_call),
``response.function_call_arguments.delta`` (all arguments at once),
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete``). An engine failure mid-stream is an
``error`` event (the gateway's code, e.g. ``engine_unavailable``) then ``response.failed``,
and the stream ends: the failed response's ``error.code`` is ``server_error`` (the SDK's
``ResponseError.code`` is a closed list) and its ``output`` holds what was streamed (the
message with the text sent so far, status "incomplete"; nothing if no text was sent).

**Storing** happens before the final event (``response.completed``) or, unstreamed, before
the body is sent: a response the client sees as stored is readable at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from server.gateway.api.completions import CompletionJob, Outcome, cached_tokens
from server.gateway.api.logprobs import chat_entries
from server.gateway.api.responses_convert import new_id
from server.gateway.api.responses_schemas import ResponsesRequest
from server.gateway.errors import ServingError

StoreCallback = Callable[[dict], Awaitable[bool]]  # the finished response object → stored?

# The bound a stored request's row is checked against before the engine runs (responses_routes):
# besides its input items (exact), the response body as echoed (exact, from the request) plus
# what is filled in at the end, and its output bounded from the output tokens it may write.
# An estimate, not a proof (a token may take more than TOKEN_BYTES): the store checks the exact
# size again, and a row that still does not fit is answered ``store: false`` and counted
# (kvgate_responses_not_stored_total).
FINISHED_BYTES = 512  # usage and its details, completed_at, incomplete_details: set when the answer ends
ITEM_BYTES = 256  # one output item's JSON around its text: ids, type, status, role, name, the output_text part
TOKEN_BYTES = 4  # one output token's text in the stored JSON (UTF-8, a few escapes)
LOGPROB_BYTES = 96  # one log-prob entry (token, bytes, logprob), per token and per top log prob asked for
MIN_CALL_TOKENS = 16  # a function call takes at least this many output tokens (its <tool_call> JSON)


def written_tokens(job: CompletionJob, outcome: Outcome) -> int:
    """Prompt tokens this request wrote to the KV cache: the engine keeps a prompt's full
    blocks for reuse, so its full blocks' tokens, less those it read from the cache
    (:func:`~server.gateway.api.completions.cached_tokens`, same tokens per block), at least 0."""
    per_block = job.tenant.pool.tokens_per_block
    return max(0, job.prompt.total // per_block * per_block - cached_tokens(job, outcome))


def usage(job: CompletionJob, outcome: Outcome) -> dict:
    total = job.prompt.total
    details = {"cached_tokens": cached_tokens(job, outcome), "cache_write_tokens": written_tokens(job, outcome)}
    return {"input_tokens": total, "input_tokens_details": details,
            "output_tokens": outcome.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total + outcome.completion_tokens}


class TextTokens:
    """How many of the generated tokens hold the first ``chars`` characters of the text, read
    with a decode stream as the core decoded them: the shortest leading run that covers them.
    Why: with tools, the tokens of a ``<tool_call>`` block held back from the text are generated
    too, and a message's log probs are its text's alone. A token holding both the text's last
    characters and a call's first counts with the text (its stream delta carried it)."""

    __slots__ = ("_push", "_chars", "count")

    def __init__(self, job: CompletionJob) -> None:
        self._push = job.tokenizer.new_decode_stream().push
        self._chars = 0  # characters the counted tokens decode to
        self.count = 0

    def cover(self, ids: Sequence[int], chars: int) -> int:
        """The count for a text of ``chars`` characters (never less than before: the text only grows)."""
        while self._chars < chars and self.count < len(ids):
            self._chars += len(self._push(ids[self.count]))
            self.count += 1
        return self.count


def _tool_echo(body: ResponsesRequest) -> list[dict]:
    return [{"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in body.tools or ()]


def _format_echo(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
    return {"format": fmt, "verbosity": (body.text.verbosity if body.text is not None else None) or "medium"}


def _cache_options_echo(body: ResponsesRequest) -> dict | None:
    """The prompt-caching options applied (OpenAI's ``Response.prompt_cache_options``), when asked for."""
    options = body.prompt_cache_options
    if options is None:
        return None
    return {"mode": options.mode or "implicit", "ttl": options.ttl or "30m",
            "comparison_response_id": options.comparison_response_id}


class ResponsesDialect:
    """Renders one ``/v1/responses`` answer; ``store`` (when the response is to be stored)
    is awaited with the finished response object before the client gets it."""

    __slots__ = ("request", "id", "created_at", "previous_response_id", "store", "result")

    def __init__(self, body: ResponsesRequest, *, previous_response_id: str | None,
                 store: StoreCallback | None) -> None:
        self.request = body
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.previous_response_id = previous_response_id
        self.store = store
        self.result: dict | None = None  # the finished response object

    def response(self, status: str, output: list[dict], job: CompletionJob | None = None,
                 outcome: Outcome | None = None, *, error: dict | None = None) -> dict:
        body = self.request
        # usage: what is billed (completions.CompletionRunner._finish): a finished answer, or a stream
        # that failed after generating tokens (the client has them)
        finished = outcome is not None and (status in ("completed", "incomplete")
                                            or status == "failed" and outcome.completion_tokens > 0)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
            "prompt_cache_options": _cache_options_echo(body),
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.safety_identifier,
            "service_tier": "default", "store": self.store is not None,
            "temperature": 1.0 if body.temperature is None else body.temperature, "text": _format_echo(body),
            "tool_choice": body.tool_choice or "auto", "tools": _tool_echo(body),
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage(job, outcome) if finished and job is not None else None,
            "user": body.user, "metadata": body.metadata or {},
        }

    def stored_bound(self, max_tokens: int) -> int:
        """Bytes the stored row's response body and output may take (besides its input items)
        when at most ``max_tokens`` are generated: see ``TOKEN_BYTES`` and the constants by it."""
        body = {k: v for k, v in self.response("completed", []).items() if k != "output"}
        size = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()) + FINISHED_BYTES
        calls = max_tokens // MIN_CALL_TOKENS if self.request.tools else 0
        if self.request.max_tool_calls is not None:
            calls = min(calls, self.request.max_tool_calls)
        size += ITEM_BYTES * (1 + calls) + TOKEN_BYTES * max_tokens
        if "message.output_text.logprobs" in (self.request.include or ()):
            size += LOGPROB_BYTES * (1 + (self.request.top_logprobs or 0)) * max_tokens
        return size

    @staticmethod
    def status(outcome: Outcome) -> str:
        return "incomplete" if outcome.finish_reason == "length" else "completed"

    def _logprobs(self, job: CompletionJob, outcome: Outcome) -> list[dict]:
        """The message's log probs: its text's tokens (with tools, only those that hold its text)."""
        if job.logprobs is None or job.token_texts is None:
            return []
        # with tools, the text's own tokens: never a call's, parsed or not (a forced call cut short is no text)
        upto = TextTokens(job).cover(outcome.token_ids, len(outcome.text)) if job.parses_tools \
            else len(outcome.log_probs)
        return chat_entries(job.token_texts, outcome.token_ids[:upto], outcome.log_probs[:upto])

    def _calls(self, outcome: Outcome) -> list[dict]:
        calls = outcome.tool_calls
        if self.request.max_tool_calls is not None:
            calls = calls[: self.request.max_tool_calls]
        return [{"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
                 "name": call.name, "arguments": call.arguments} for call in calls]

    def _message(self, ident: str, text: str, status: str, logprobs: list[dict]) -> dict:
        return {"id": ident, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}

    def output(self, job: CompletionJob, outcome: Outcome, message_id: str | None = None) -> list[dict]:
        items: list[dict] = []
        if outcome.text or not outcome.tool_calls:
            items.append(self._message(message_id or new_id("msg"), outcome.text, self.status(outcome),
                                       self._logprobs(job, outcome)))
        return items + self._calls(outcome)

    def body(self, job: CompletionJob, outcome: Outcome) -> dict:
        """Unstreamed: the response object; the route then calls :meth:`finalize` (the store)."""
        self.result = self.response(self.status(outcome), self.output(job, outcome), job, outcome)
        return self.result

    async def finalize(self) -> dict:
        """Store the finished response (when asked) and return it as the client gets it:
        ``store`` says whether it really was stored (false when the byte cap was reached)."""
        assert self.result is not None
        if self.store is not None:
            self.result = {**self.result, "store": await self.store(self.result)}
        return self.result

    async def stream(self, job: CompletionJob, outcome: Outcome, deltas: AsyncIterator[str]) -> AsyncIterator[bytes]:
        sequence = 0

        def event(kind: str, payload: dict[str, Any]) -> bytes:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **payload}
            sequence += 1
            return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        # with tools, the tokens that hold the text sent so far (a held-back tool call's are not the text's)
        text_tokens = TextTokens(job) if job.logprobs is not None and job.parses_tools else None
        streamed = 0  # characters of text sent

        def pending(job: CompletionJob, outcome: Outcome, delta: str) -> list[dict]:
            """The log probs of the tokens decoded since the last delta (text held back keeps its own),
            with tools only those of the text sent (:class:`TextTokens`)."""
            nonlocal streamed
            if job.logprobs is None or job.token_texts is None:
                return []
            upto = len(outcome.log_probs)
            if text_tokens is not None:
                streamed += len(delta)
                upto = min(upto, text_tokens.cover(outcome.token_ids, streamed))
            start, outcome.sent_log_probs = outcome.sent_log_probs, upto
            return chat_entries(job.token_texts, outcome.token_ids[start:upto], outcome.log_probs[start:upto])

        yield event("response.created", {"response": self.response("in_progress", [])}) + \
            event("response.in_progress", {"response": self.response("in_progress", [])})
        message_id = new_id("msg")
        opened = False
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        sent: list[str] = []  # the text deltas sent, and their log probs: a failed response's output
        sent_logprobs: list[dict] = []
        try:
            async for delta in deltas:
                if not opened:
                    opened = True
                    yield event("response.output_item.added", {"output_index": 0, "item": {
                        "id": message_id, "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}}) + event("response.content_part.added", {**where, "part": empty_part})
                logprobs = pending(job, outcome, delta)
                sent.append(delta)
                sent_logprobs.extend(logprobs)
                yield event("response.output_text.delta", {**where, "delta": delta, "logprobs": logprobs})
        except ServingError as err:  # the engine failed mid-stream
            # the error event keeps the gateway's code; the response's code is from the SDK's closed list
            failed = self.response("failed", [self._message(message_id, "".join(sent), "incomplete", sent_logprobs)] if opened else [],
                                   job, outcome, error={"code": "server_error", "message": err.message})
            yield event("error", {"code": err.code, "message": err.message, "param": err.param}) + \
                event("response.failed", {"response": failed})
            return
        output = self.output(job, outcome, message_id)
        closing = b""
        index = 0
        if output and output[0]["type"] == "message":
            message = output[0]
            part = message["content"][0]
            if not opened:  # no text delta came: the (empty) message still opens
                closing += event("response.output_item.added", {"output_index": 0, "item": {
                    "id": message_id, "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}}) + event("response.content_part.added", {**where, "part": empty_part})
            closing += event("response.output_text.done", {**where, "text": part["text"], "logprobs": part["logprobs"]})
            closing += event("response.content_part.done", {**where, "part": part})
            closing += event("response.output_item.done", {"output_index": 0, "item": message})
            index = 1
        for item in output[index:]:
            added = {**item, "status": "in_progress", "arguments": ""}
            at = {"item_id": item["id"], "output_index": index}
            closing += event("response.output_item.added", {"output_index": index, "item": added})
            closing += event("response.function_call_arguments.delta", {**at, "delta": item["arguments"]})
            closing += event("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                       "arguments": item["arguments"]})
            closing += event("response.output_item.done", {"output_index": index, "item": item})
            index += 1
        yield closing  # before the store: the client sees the items while the row is written
        self.result = self.response(self.status(outcome), output, job, outcome)
        final = await self.finalize()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event(kind, {"response": final})
