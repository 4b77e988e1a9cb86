"""The OpenAI dialect's rendering: chat/text completion bodies and their SSE chunks.

A :class:`~server.gateway.api.completions.Dialect` over the one request core: it only turns
the core's :class:`~server.gateway.api.completions.Outcome` and text deltas into OpenAI's
shapes (``chat.completion``, ``text_completion``, ``chat.completion.chunk``, ``data: [DONE]``,
an ``{"error": ...}`` frame when the engine fails mid-stream).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

from server.gateway.api.completions import CompletionJob, Outcome, cached_tokens
from server.gateway.api.logprobs import chat_entries, completion_block
from server.gateway.errors import ServingError, error_body


class OpenAIDialect:
    """Renders ``/v1/chat/completions`` and ``/v1/completions`` answers (stateless)."""

    __slots__ = ()
    # A KEEP_ALIVE delta (streaming.KEEP_ALIVE) is an SSE comment line, which SSE clients skip
    # (the openai SDK's SSEDecoder, curl, browsers' EventSource): no chunk the client must parse.
    keeps_alive = True

    @staticmethod
    def usage(job: CompletionJob, outcome: Outcome) -> dict:
        return {"prompt_tokens": job.prompt.total, "completion_tokens": outcome.completion_tokens,
                "total_tokens": job.prompt.total + outcome.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens(job, outcome)}}

    def body(self, job: CompletionJob, outcome: Outcome) -> dict:
        ident, created = _ident(job), int(time.time())
        if job.kind == "chat":
            message: dict = {"role": "assistant", "content": outcome.text}
            if outcome.tool_calls:
                message["content"] = outcome.text or None
                message["tool_calls"] = [call.to_openai() for call in outcome.tool_calls]
            choice = {"index": 0, "message": message, "finish_reason": outcome.finish_reason,
                      "logprobs": _chat_logprobs(job, outcome, len(outcome.log_probs))}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason,
                      "logprobs": _text_logprobs(job, outcome, len(outcome.log_probs), 0)}
            obj = "text_completion"
        return {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [choice],
                "usage": self.usage(job, outcome)}

    async def stream(self, job: CompletionJob, outcome: Outcome, deltas: AsyncIterator[str]) -> AsyncIterator[bytes]:
        ident, created = _ident(job), int(time.time())
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        continuous = job.include_usage and job.continuous_usage
        usage = self.usage
        text_offset = 0

        def frame(delta_text: str | None, finish: str | None, *, role: bool = False, tool_calls: list | None = None,
                  logprobs: dict | None = None) -> bytes:
            if chat:
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": logprobs}
            payload = {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [choice]}
            if job.include_usage:
                # vLLM's continuous_usage_stats: running usage in every chunk; otherwise null until the last
                payload["usage"] = usage(job, outcome) if continuous else None
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def pending_logprobs() -> dict | None:
            nonlocal text_offset
            if job.logprobs is None:
                return None
            upto = len(outcome.log_probs)
            start, outcome.sent_log_probs = outcome.sent_log_probs, upto
            if chat:
                return _chat_logprobs(job, outcome, upto, start)
            block = _text_logprobs(job, outcome, upto, start, text_offset)
            text_offset += sum(len(t) for t in block["tokens"]) if block else 0
            return block

        # Why: one frame per token is the streaming hot path; only the text changes, so the
        # rest of the frame is rendered once (byte-identical to ``frame(text, None)``).
        simple = job.logprobs is None and not continuous
        head, tail = frame("\x00", None).split(b'"\\u0000"')

        # The role frame goes out with the first frame after it (one socket write less),
        # unless text may be held back for long (tool calls): then at once, as alone.
        opening = frame(None, None, role=True) if chat else b""
        if opening and (not simple or job.parses_tools):
            yield opening
            opening = b""
        try:
            async for delta in deltas:
                if not delta:  # KEEP_ALIVE: a tool call's text is held back
                    out, opening = opening + b": keep-alive\n\n", b""
                    yield out
                    continue
                if simple:
                    # what json.dumps does for a str with its defaults, minus two calls
                    out = head + _json_str(delta).encode() + tail
                    if opening:
                        out, opening = opening + out, b""
                    yield out
                else:
                    yield frame(delta, None, logprobs=pending_logprobs())
        except ServingError as err:  # the engine failed mid-stream
            yield opening + b"data: " + json.dumps(error_body(err.status, err.code, err.message)).encode() + b"\n\n"
            return
        closing = b""
        if job.logprobs is not None and outcome.sent_log_probs < len(outcome.log_probs):
            closing += frame(None, None, logprobs=pending_logprobs())  # tokens whose text was held back
        if outcome.tool_calls:
            closing += frame(None, None, tool_calls=[c.to_openai(i) for i, c in enumerate(outcome.tool_calls)])
        # The closing frames are ready together: one body message (one socket write)
        # instead of up to three, same bytes.
        closing += frame(None, outcome.finish_reason)
        closing = opening + closing
        if job.include_usage:
            last = {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [],
                    "usage": usage(job, outcome)}
            closing += b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n"
        yield closing + b"data: [DONE]\n\n"


OPENAI = OpenAIDialect()


def _chat_logprobs(job: CompletionJob, outcome: Outcome, upto: int, start: int = 0) -> dict | None:
    if job.logprobs is None or job.token_texts is None:
        return None
    return {"content": chat_entries(job.token_texts, outcome.token_ids[start:upto], outcome.log_probs[start:upto]),
            "refusal": None}


def _text_logprobs(job: CompletionJob, outcome: Outcome, upto: int, start: int = 0, offset: int = 0) -> dict | None:
    if job.logprobs is None or job.token_texts is None:
        return None
    return completion_block(job.token_texts, outcome.token_ids[start:upto], outcome.log_probs[start:upto],
                            offset=offset, with_top=job.logprobs > 0)


_json_str = json.encoder.encode_basestring_ascii  # json.dumps(str) == _json_str(str) (ensure_ascii)


def _ident(job: CompletionJob) -> str:
    return ("chatcmpl-" if job.kind == "chat" else "cmpl-") + secrets.token_hex(12)
