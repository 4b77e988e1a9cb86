"""One serving request from admission to the last byte: the gateway's hot path.

``run_completion`` returns either a JSON body or an SSE stream. Invariants:

* the admission lease is released exactly once, whatever happens (client gone,
  engine error, stop string);
* leaving early (client disconnect, stop string) closes the engine stream, which
  cancels the engine request and frees its blocks;
* usage and metrics are recorded once per admitted request, with the tokens actually
  generated.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from engines.contract import EngineRequest, KvMetrics, SamplingParams
from engines.tokenizer import ChatTokenizer
from retention.adaptive import ReuseStats, adaptive_plan
from retention.hashing import block_hashes
from retention.planner import QuotaState, Segments, plan_retention
from retention.types import RetentionPlan
from server.gateway.admission import Admission, AdmissionError, retry_after_header
from server.gateway.context import TenantContext
from server.gateway.engine_client import EngineClient, EngineRejected, EngineUnavailable
from server.gateway.errors import ServingError, error_body
from server.gateway.metrics import GatewayMetrics
from server.gateway.routing import RoutedEngine
from server.gateway.prompting import PreparedPrompt


@dataclass(slots=True)
class CompletionJob:
    """Everything the hot path needs, resolved before admission."""

    tenant: TenantContext
    kind: str  # "chat" | "text"
    model: str
    prompt: PreparedPrompt
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tokenizer: ChatTokenizer
    engine: RoutedEngine | EngineClient  # anything with EngineClient.generate's signature
    quota: QuotaState = field(default_factory=QuotaState)


@dataclass(slots=True)
class Outcome:
    pieces: list[str] = field(default_factory=list)  # the completion's text deltas, in order
    completion_tokens: int = 0
    finish_reason: str | None = None
    kv: KvMetrics | None = None
    ttft: float | None = None
    status: str = "ok"

    @property
    def text(self) -> str:
        return "".join(self.pieces)


REPLICA_HEADER = "x-kvgate-replica"
UsageSink = Callable[[int, int, int], None]  # (tenant_id, prompt_tokens, completion_tokens)


class StopMatcher:
    """Incremental text with stop strings: emits only text that cannot start a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buffer += text
        if self._stops:
            cut = min((i for i in (self._buffer.find(s) for s in self._stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out, self._buffer = self._buffer[:cut], ""
                return out
        if len(self._buffer) <= self._hold:
            return ""
        emit_upto = len(self._buffer) - self._hold
        out, self._buffer = self._buffer[:emit_upto], self._buffer[emit_upto:]
        return out

    def flush(self) -> str:
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out


def build_plan(job: CompletionJob, reuse: ReuseStats | None = None, now: float = 0.0) -> RetentionPlan:
    """The request's retention plan.

    ``static`` classes: segment priorities from the class. ``adaptive`` classes: per-block
    priorities from the tenant's measured reuse (``retention.adaptive``, the same code the
    simulator's ``adaptive`` policy runs), hashed exactly as the engine's pool hashes them
    (pool ``tokens_per_block``, the salt the engine will see); the request is then recorded
    in the statistics. Over quota, either way: everything at priority 0.
    """
    prompt, tenant = job.prompt, job.tenant
    threshold = tenant.pool.secondary_offload_min_priority
    segments = Segments(system_end=prompt.system_end, context_end=prompt.context_end, total=prompt.total)
    if tenant.retention_mode != "adaptive" or reuse is None or job.quota.over_quota:
        return plan_retention(tenant.retention, segments, offload_min_priority=threshold, quota=job.quota)
    tpb = tenant.pool.tokens_per_block
    hashes = block_hashes(prompt.input_ids, tpb, salt=tenant.engine_salt)
    key = tenant.engine_tenant_id
    plan = adaptive_plan(reuse, key, hashes, num_tokens=prompt.total, tokens_per_block=tpb,
                         offload_min_priority=threshold, decode_priority=tenant.retention.decode.priority)
    reuse.observe(key, hashes, now, num_blocks=-(-prompt.total // tpb))
    return plan


def engine_request(job: CompletionJob, plan: RetentionPlan) -> EngineRequest:
    # Why not always stream from the engine: each streamed gRPC message costs the gateway
    # ~0.14 ms of CPU; a non-streaming answer without stop strings needs one message.
    # Stop strings need the stream so the engine can be cancelled at the match.
    streaming = job.stream or bool(job.stop)
    return EngineRequest(
        input_ids=job.prompt.input_ids, max_new_tokens=job.max_new_tokens, end_id=job.tokenizer.eos_token_id,
        streaming=streaming, sampling=job.sampling, retention=plan, cache_salt=job.tenant.engine_salt,
        tenant_id=job.tenant.engine_tenant_id,
    )


async def _generate(job: CompletionJob, plan: RetentionPlan, outcome: Outcome, started: float) -> AsyncIterator[str]:
    """Text deltas of the completion; fills ``outcome`` as it goes.

    Runs once per engine response (per token when streaming), so the common cases take
    short paths: a response with one token skips the join, and without stop strings the
    text needs no :class:`StopMatcher` (which, with nothing to hold back, returns its
    input unchanged and never stops).
    """
    push_token = job.tokenizer.new_decode_stream().push
    matcher = StopMatcher(job.stop) if job.stop else None
    request_id = secrets.token_hex(8)
    request = engine_request(job, plan)
    streamed = request.streaming  # TTFT is only observable when the engine streams
    pieces = outcome.pieces
    async with contextlib.aclosing(job.engine.generate(request, request_id=request_id)) as chunks:
        async for chunk in chunks:
            outcome.kv = chunk.kv
            if chunk.generated > outcome.completion_tokens:
                outcome.completion_tokens = chunk.generated
            ids = chunk.token_ids
            if not ids:
                text = ""
            else:
                if outcome.ttft is None and streamed:
                    outcome.ttft = time.perf_counter() - started
                text = push_token(ids[0]) if len(ids) == 1 else "".join([push_token(t) for t in ids])
            if matcher is None:
                if text:
                    pieces.append(text)
                    yield text
                continue
            delta = matcher.push(text)
            if delta:
                pieces.append(delta)
                yield delta
            if matcher.stopped:
                outcome.finish_reason = "stop"
                return  # closes the engine stream: the engine cancels and frees the blocks
    tail = matcher.flush() if matcher is not None else ""
    if tail:
        pieces.append(tail)
        yield tail
    outcome.finish_reason = "length" if outcome.completion_tokens >= job.max_new_tokens else "stop"


def _engine_error(exc: Exception) -> ServingError:
    if isinstance(exc, EngineRejected):
        return ServingError(400, "engine_rejected", f"the engine refused the request: {exc}")
    return ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly",
                        headers={"Retry-After": "1"})


class CompletionRunner:
    """Runs :class:`CompletionJob` s against the injected admission, metrics and usage sink."""

    def __init__(self, *, admission: Admission, metrics: GatewayMetrics, usage: UsageSink,
                 reuse_for: Callable[[str], ReuseStats] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admission = admission
        self._metrics = metrics
        self._usage = usage
        self._reuse_for = reuse_for
        self._clock = clock

    async def run(self, job: CompletionJob):
        tenant = job.tenant
        try:
            lease = await self._admission.acquire(
                tenant.slug, tenant.limits, prompt_tokens=job.prompt.total, max_output_tokens=job.max_new_tokens
            )
        except AdmissionError as exc:
            self._metrics.rate_limited.labels(tenant.slug, exc.limit).inc()
            headers = {"Retry-After": retry_after_header(exc)} if exc.status == 429 else None
            code = "rate_limit_exceeded" if exc.status == 429 else "limit_exceeded"
            raise ServingError(exc.status, code, str(exc), param=exc.limit, headers=headers) from exc
        reuse = self._reuse_for(job.tenant.pool.name) if self._reuse_for is not None else None
        plan = build_plan(job, reuse, self._clock())
        started = time.perf_counter()
        outcome = Outcome()
        if job.stream:
            return StreamingResponse(self._sse(job, plan, outcome, started, lease), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in _generate(job, plan, outcome, started):
                pass
        except (EngineUnavailable, EngineRejected) as exc:
            outcome.status = "engine_error"
            raise _engine_error(exc) from exc
        finally:
            await self._finish(job, plan, outcome, started, lease)
        replica = getattr(job.engine, "replica", None)
        # Like x-gateway-destination-endpoint of the Gateway API Inference Extension
        # (kubernetes-sigs/gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol):
        # which engine replica served the answer, named as in the registry (not an address).
        headers = {REPLICA_HEADER: replica} if replica else None
        return JSONResponse(self._body(job, outcome), headers=headers)

    async def _finish(self, job, plan, outcome: Outcome, started: float, lease) -> None:
        await self._admission.release(lease, completion_tokens=outcome.completion_tokens)
        tenant = job.tenant
        self._metrics.observe_request(
            tenant=tenant.slug, pool=tenant.pool.name, status=outcome.status, prompt_tokens=job.prompt.total,
            completion_tokens=outcome.completion_tokens, ttft=outcome.ttft, latency=time.perf_counter() - started,
            kv=outcome.kv, demoted=plan.demoted,
        )
        self._usage(tenant.tenant_id, job.prompt.total, outcome.completion_tokens)

    def _usage_body(self, job: CompletionJob, outcome: Outcome) -> dict:
        return {"prompt_tokens": job.prompt.total, "completion_tokens": outcome.completion_tokens,
                "total_tokens": job.prompt.total + outcome.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": _cached_tokens(job, outcome)}}

    def _body(self, job: CompletionJob, outcome: Outcome) -> dict:
        ident, created = _ident(job), int(time.time())
        if job.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                      "finish_reason": outcome.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [choice],
                "usage": self._usage_body(job, outcome)}

    async def _sse(self, job: CompletionJob, plan, outcome: Outcome, started: float, lease) -> AsyncIterator[bytes]:
        ident, created = _ident(job), int(time.time())
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def frame(delta_text: str | None, finish: str | None, *, role: bool = False) -> bytes:
            if chat:
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [choice]}
            if job.include_usage:
                payload["usage"] = None
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        # Why: one frame per token is the streaming hot path; only the text changes, so the
        # rest of the frame is rendered once (byte-identical to ``frame(text, None)``).
        head, tail = frame("\x00", None).split(b'"\\u0000"')

        try:
            if chat:
                yield frame(None, None, role=True)
            try:
                async for delta in _generate(job, plan, outcome, started):
                    # what json.dumps does for a str with its defaults, minus two calls
                    yield head + _json_str(delta).encode() + tail
            except (EngineUnavailable, EngineRejected) as exc:
                outcome.status = "engine_error"
                err = _engine_error(exc)
                yield b"data: " + json.dumps(error_body(err.status, err.code, err.message)).encode() + b"\n\n"
                return
            # The closing frames are ready together: one body message (one socket write)
            # instead of up to three, same bytes.
            closing = frame(None, outcome.finish_reason)
            if job.include_usage:
                usage = {"id": ident, "object": obj, "created": created, "model": job.model, "choices": [],
                         "usage": self._usage_body(job, outcome)}
                closing += b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
            yield closing + b"data: [DONE]\n\n"
        except BaseException:
            if outcome.status == "ok":
                outcome.status = "client_gone"
            raise
        finally:
            await self._finish(job, plan, outcome, started, lease)


_json_str = json.encoder.encode_basestring_ascii  # json.dumps(str) == _json_str(str) (ensure_ascii)


def _ident(job: CompletionJob) -> str:
    return ("chatcmpl-" if job.kind == "chat" else "cmpl-") + secrets.token_hex(12)


def _cached_tokens(job: CompletionJob, outcome: Outcome) -> int:
    if outcome.kv is None:
        return 0
    return min(job.prompt.total, outcome.kv.reused_blocks * job.tenant.pool.tokens_per_block)
