"""One serving request from admission to the last byte: the gateway's hot path, one for every dialect.

:meth:`CompletionRunner.run` takes a :class:`CompletionJob` (already converted from the
client's dialect) and a :class:`Dialect` that renders the result, and returns either a
JSON body or an SSE stream. The core owns admission, planning, routing, the engine call,
metrics and usage; a dialect only renders (``server.gateway.api.openai_render``,
``server.gateway.api.messages_render``). What the core hands a dialect is neutral: the
:class:`Outcome` (text pieces, tool calls, finish reason, stop string, KV metrics) and, when
streaming, an async iterator of text deltas that raises :class:`ServingError` if the engine
fails after the stream started. Invariants:

* the admission lease is released exactly once, whatever happens (client gone,
  engine error, stop string), and for a stream even when its body never starts
  (:class:`ClosingStreamingResponse`); a failure before the engine call (planning) releases
  it as never served (``Admission.release_unserved``);
* leaving early (client disconnect, stop string) closes the engine stream, which
  cancels the engine request and frees its blocks; a client that leaves before its response
  starts (while a non-streamed answer is generated, or before a stream's first token) is
  noticed from the request's ``receive`` (``streaming.CLIENT_RECEIVE``): the engine call is
  cancelled then, not at its end, and the request is not retried on another replica;
* a non-streamed answer the engine streams (stop strings) reaches the client only whole, so
  when its replica fails or stalls mid-answer it is run again on another one (the router's
  retry budget, :class:`~server.gateway.replicas.stall.EngineRestart`), and what the failed
  attempt generated is dropped;
* metrics are recorded once per admitted request; usage once per admitted request an engine
  served (a 503/504 instead of a non-streamed answer is not billed, whatever the engine generated
  before failing, nor a client gone before the engine's first response; a stream that failed after
  its start is billed the tokens it sent), with the tokens actually generated, and the usage is durable
  before the answer's end reaches the client (a JSON body is built after it; a stream's
  closing frames are held until it);
* a streamed response starts (status 200, headers) only once the engine's first response
  is in hand: the replica is then final (no retry after it), so ``x-kvgate-replica`` names
  the one that serves the stream, and a failure before it (no replica, refusal, first-token
  deadline) is an HTTP error with the dialect's error body, as for non-streamed requests.
  Failures after it can only be reported in the stream (the dialect's ``error`` event).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from fastapi.responses import JSONResponse

from engines.contract import EngineRequest, Guide, KvMetrics, SamplingParams, TokenLogProbs, cached_prompt_tokens
from engines.tokenizer import ChatTokenizer
from retention.hashing import block_hashes
from retention.policy.conversation import ConversationPlan, ConversationRequest
from retention.policy.hint_quota import HintedPlan, HintLedger, cache_creation, keep_pins, plan_with_hints
from retention.policy.hints import CacheHints
from retention.policy.planner import QuotaState, Segments, plan_retention
from retention.policy.selection import AdaptiveSelector
from retention.types import RetentionPlan
from server.gateway.admission import Admission, AdmissionError, RateLevels
from server.gateway.rate_headers import openai_rate_headers, refusal_headers
from server.gateway.context import TenantContext
from server.gateway.replicas.abort import GatewayShuttingDown
from server.gateway.replicas.engine_client import EngineChunk, EngineClient, EngineRejected, EngineUnavailable
from server.gateway.errors import ServingError
from server.gateway.fresh_admission import admit
from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.api.logprobs import TokenTexts
from server.gateway.observe.miss_ratio import MissRatioCurves
from server.gateway.replicas.routing import RoutedEngine
from server.gateway.replicas.stall import EngineRestart
from server.gateway.api.engine_errors import engine_error
from server.gateway.api.stops import StopMatcher
from server.gateway.api.prompting import PreparedPrompt
from server.gateway.api.streaming import (CLIENT_RECEIVE, KEEP_ALIVE, KEEP_ALIVE_SECONDS, ClosingStreamingResponse,
                                          LastFrame, UntilDisconnect, run_once_shielded)
from server.gateway.observe.slo_guard import SloGuards
from server.gateway.api.conversation_hold import ConversationHolds
from server.gateway.api.tools import CALL_CLOSE, OutputRouter, ToolCall, ToolPlan, parse_forced, parse_tool_calls
from tenants.snapshots import PoolSnapshot


@dataclass(slots=True)
class CompletionJob:
    """Everything the hot path needs, resolved before admission."""

    tenant: TenantContext
    kind: str  # "chat" | "text"
    model: str
    prompt: PreparedPrompt
    max_new_tokens: int | None  # None: the tenant's default output limit, resolved at admission (then set)
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tokenizer: ChatTokenizer
    engine: RoutedEngine | EngineClient  # anything with EngineClient.generate's signature
    quota: QuotaState = field(default_factory=QuotaState)
    # guided decoding, tools, log probabilities, extensions
    guide: Guide | None = None
    # the dialect's names for the output limit and for an output format (a guide not from tools), in errors
    output_param: str = "max_tokens"
    format_param: str = "response_format"
    tools: ToolPlan | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: not asked; else how many alternatives per token
    token_texts: TokenTexts | None = None
    continuous_usage: bool = False
    hints: CacheHints = field(default_factory=CacheHints)  # client cache intent (retention.policy.hints), any dialect
    conversation: ConversationRequest | None = None  # Responses: response id, previous, store (conversation_hold.py)

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.parses


@dataclass(slots=True)
class Outcome:
    pieces: list[str] = field(default_factory=list)  # the completion's text deltas, in order
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" (neutral; dialects rename)
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    kv: KvMetrics | None = None
    first_kv: KvMetrics | None = None  # a stream's first engine response's KV metrics, before any delta
    ttft: float | None = None
    # The engine failed (timed out, unavailable; not a refusal) before the first token of a streamed
    # engine call: the SLO guard takes the time waited as its TTFT (over budget, not unmeasured).
    no_first_token: bool = False
    status: str = "ok"
    arm: str | None = None  # SLO guard / pilot arm the plan was made for (server.gateway.observe.slo_guard)
    token_ids: list[int] = field(default_factory=list)  # generated ids, kept only when log probs are asked
    log_probs: list[TokenLogProbs] = field(default_factory=list)
    sent_log_probs: int = 0  # how many of log_probs went out in stream frames
    held: list[str] = field(default_factory=list)  # text kept back from the content (tool calls)
    tool_calls: list[ToolCall] = field(default_factory=list)
    hinted: HintedPlan | None = None  # the client's hints as planned (recorded again at release)
    conversation_hold: ConversationPlan | None = None  # the conversation hold as planned (recorded again at release)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


REPLICA_HEADER = "x-kvgate-replica"
# (tenant_id, prompt_tokens, completion_tokens, *cache_usage(), by position) -> None, or an awaitable done once the
# usage is durable (server.gateway.usage.UsageRecorder.record with its journal; its cache counts default to 0)
UsageSink = Callable[..., Awaitable[None] | None]
CaptureSink = Callable[..., bool]  # server.gateway.observe.capture.TraceCaptures.offer (keyword arguments)


class Dialect(Protocol):
    """How one API renders what the core produced (errors before a stream starts are
    rendered by the app's exception handler for the dialect's paths)."""

    def body(self, job: CompletionJob, outcome: Outcome) -> dict:
        """The JSON answer of a finished, non-streamed request."""
        ...

    def stream(self, job: CompletionJob, outcome: Outcome, deltas: AsyncIterator[str]) -> AsyncIterator[bytes]:
        """The SSE body: ``deltas`` are the text deltas (``outcome`` fills as they come);
        it raises :class:`ServingError` when the engine fails mid-stream, which the dialect
        renders as its error event and then ends."""
        ...


def request_hashes(job: CompletionJob) -> list[int]:
    """The prompt's full-block chain hashes exactly as the engine's pool computes them (pool
    ``tokens_per_block``, the salt the engine will see): computed once per request and shared
    by adaptive retention and the miss-ratio curves."""
    tenant = job.tenant
    return block_hashes(job.prompt.input_ids, tenant.pool.tokens_per_block, salt=tenant.engine_salt)


def build_plan(job: CompletionJob, selector: AdaptiveSelector | None = None, now: float = 0.0,
               hashes: list[int] | None = None) -> RetentionPlan:
    """The request's retention plan.

    ``static`` classes: segment priorities from the class. ``adaptive`` classes: the pool's
    :class:`~retention.policy.selection.AdaptiveSelector` (the same code the simulator's
    ``adaptive`` policy runs) picks between the class's plan and adaptive's per-block bands,
    whichever wins on its sampled shadow pools, from block hashes computed exactly as the
    engine's pool computes them (pool ``tokens_per_block``, the salt the engine will see);
    the request is then recorded in the selector. Over quota, either way: everything at
    priority 0, and the selector is not touched. Client hints go on top of this plan
    (:func:`hinted_plan`), never into it.
    """
    prompt, tenant = job.prompt, job.tenant
    threshold = tenant.pool.secondary_offload_min_priority
    segments = Segments(system_end=prompt.system_end, context_end=prompt.context_end, total=prompt.total)
    static = plan_retention(tenant.retention, segments, offload_min_priority=threshold, quota=job.quota)
    if tenant.retention_mode != "adaptive" or selector is None or job.quota.over_quota:
        return static
    tpb = tenant.pool.tokens_per_block
    if hashes is None:
        hashes = request_hashes(job)
    return selector.plan(tenant=tenant.engine_tenant_id, hashes=hashes, num_tokens=prompt.total, tokens_per_block=tpb,
                         static=static, now=now, decode_priority=tenant.retention.decode.priority)


def hints_apply(job: CompletionJob) -> bool:
    """Whether the request's hints can change its plan (the class honours hints, and they say something)."""
    return job.tenant.hints.enabled and (bool(job.hints.breakpoints) or job.hints.retention == "24h")


def hinted_plan(job: CompletionJob, plan: RetentionPlan, hashes: list[int] | None, ledger: HintLedger,
                now: float) -> HintedPlan:
    """``plan`` (static or adaptive, after quota) with the client's hints on top, within the
    tenant's class (:mod:`retention.policy.hint_plan`) and its hint budget: ``hint_quota_fraction``
    of its KV quota of the pool's GPU blocks, counted by ``ledger`` (:mod:`retention.policy.hint_quota`).
    The same plan object when no hint applies (the engine request is then byte-identical)."""
    if not hints_apply(job):
        return HintedPlan(plan)
    tenant = job.tenant
    if hashes is None:
        hashes = request_hashes(job)
    budget = tenant.hints.budget_blocks(tenant.kv_quota_fraction, tenant.pool.primary_blocks)
    return plan_with_hints(plan, job.hints, tenant.hints, total=job.prompt.total,
                           tokens_per_block=tenant.pool.tokens_per_block, hashes=hashes, ledger=ledger,
                           tenant=tenant.engine_tenant_id, budget_blocks=budget, now=now)


def engine_request(job: CompletionJob, plan: RetentionPlan) -> EngineRequest:
    # Why not always stream from the engine: each streamed gRPC message costs the gateway
    # ~0.14 ms of CPU; a non-streaming answer without stop strings needs one message.
    # Stop strings need the stream so the engine can be cancelled at the match.
    streaming = job.stream or bool(job.stop)
    return EngineRequest(
        input_ids=job.prompt.input_ids, max_new_tokens=job.max_new_tokens, end_id=job.tokenizer.eos_token_id,
        streaming=streaming, sampling=job.sampling, retention=plan, cache_salt=job.tenant.engine_salt,
        tenant_id=job.tenant.engine_tenant_id, ignore_eos=job.ignore_eos, return_log_probs=job.logprobs is not None,
        num_top_log_probs=job.logprobs or 0, guide=job.guide,
    )


def _open(job: CompletionJob, plan: RetentionPlan,
          hashes: list[int] | None = None) -> tuple[EngineRequest, AsyncIterator[EngineChunk]]:
    """The engine request and its (not yet started) stream of chunks. ``hashes`` (from
    :func:`request_hashes`) go on to the router, which would otherwise hash the prompt again."""
    request = engine_request(job, plan)
    return request, _chunks(job, request, hashes)


def _chunks(job: CompletionJob, request: EngineRequest, hashes: list[int] | None) -> AsyncIterator[EngineChunk]:
    """A new engine call for ``request``. Routed, a non-streamed answer the engine streams is
    *restartable*: nothing of it reaches the client before its end."""
    if isinstance(job.engine, RoutedEngine):
        return job.engine.generate(request, request_id=secrets.token_hex(8), hashes=hashes,
                                   restartable=not job.stream and request.streaming)
    return job.engine.generate(request, request_id=secrets.token_hex(8))


def _restarted(outcome: Outcome) -> Outcome:
    """A fresh outcome for an answer run again: the plan's parts kept, what was generated dropped."""
    return Outcome(arm=outcome.arm, hinted=outcome.hinted, conversation_hold=outcome.conversation_hold)


def _client_gone() -> ServingError:
    """What a request whose client left before its answer ends with (nobody reads it; nginx's code)."""
    return ServingError(499, "client_closed_request", "the client closed the connection before the answer")


class PrimedChunks:
    """An engine stream whose first chunk is fetched ahead (:meth:`prime`), then replayed.

    Why: the routed engine may retry on another replica until it yields its first chunk;
    after that the replica is final, so a streamed response can name it in its headers.
    :meth:`aclose` closes the underlying stream whether or not it was ever iterated.
    """

    __slots__ = ("_chunks", "_first", "first_at", "first")

    def __init__(self, chunks: AsyncIterator[EngineChunk]) -> None:
        self._chunks = chunks
        self._first: EngineChunk | None = None
        self.first: EngineChunk | None = None  # the first chunk, kept after it was replayed
        self.first_at: float | None = None  # perf_counter() when the first chunk arrived, if it held tokens

    async def prime(self) -> None:
        """Wait for the first chunk; raises what the engine raises before it."""
        try:
            self._first = self.first = await anext(self._chunks)
        except StopAsyncIteration:
            return
        if self._first.token_ids:  # TTFT, as _generate would have measured it
            self.first_at = time.perf_counter()

    def __aiter__(self) -> PrimedChunks:
        return self

    async def __anext__(self) -> EngineChunk:
        first = self._first
        if first is not None:
            self._first = None
            return first
        return await anext(self._chunks)

    async def aclose(self) -> None:
        await self._chunks.aclose()


async def _generate(job: CompletionJob, request: EngineRequest, chunks: AsyncIterator[EngineChunk], outcome: Outcome,
                    started: float, keep_alive: float | None = None) -> AsyncIterator[str]:
    """Text deltas of the completion from the engine stream ``chunks`` (of ``request``);
    fills ``outcome`` as it goes, and closes ``chunks`` when it ends or is closed.

    Runs once per engine response (per token when streaming), so the common cases take
    short paths: a response with one token skips the join, and without stop strings the
    text needs no :class:`StopMatcher` (which, with nothing to hold back, returns its
    input unchanged and never stops).
    """
    if job.parses_tools or job.logprobs is not None:
        async for delta in _generate_extended(job, request, chunks, outcome, started, keep_alive):
            yield delta
        return
    push_token = job.tokenizer.new_decode_stream().push
    matcher = StopMatcher(job.stop) if job.stop else None
    streamed = request.streaming  # TTFT is only observable when the engine streams
    pieces = outcome.pieces
    async with contextlib.aclosing(chunks):
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
                outcome.stop_sequence = matcher.matched
                return  # closes the engine stream: the engine cancels and frees the blocks
    tail = matcher.flush() if matcher is not None else ""
    if tail:
        pieces.append(tail)
        yield tail
    outcome.finish_reason = "length" if outcome.completion_tokens >= job.max_new_tokens else "stop"


async def _generate_extended(job: CompletionJob, request: EngineRequest, chunks: AsyncIterator[EngineChunk],
                             outcome: Outcome, started: float, keep_alive: float | None = None) -> AsyncIterator[str]:
    """:func:`_generate` for requests with log probabilities or tools (the slower, general path).

    Content deltas are yielded as usual; with tools, text that belongs to a tool call is
    kept in ``outcome.held`` and parsed into ``outcome.tool_calls`` at the end (forced
    calls: all of it, and none of it is content even if it does not parse; ``auto``: from
    the first ``<tool_call>`` on, content again if it does not parse). Stop strings apply to
    the content only (:class:`~server.gateway.api.tools.OutputRouter`), never to a call.
    ``keep_alive`` (seconds, a stream whose dialect renders :data:`KEEP_ALIVE`): while text is
    held for a call, :data:`KEEP_ALIVE` is yielded after an engine chunk once that long has
    passed without a yield, so a long call is not minutes of silence to proxies.
    """
    push_token = job.tokenizer.new_decode_stream().push
    tools = job.tools
    router = OutputRouter(job.stop, tools.mode if tools is not None else None)
    streamed = request.streaming
    quiet_since = time.monotonic()
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            outcome.kv = chunk.kv
            outcome.completion_tokens = max(outcome.completion_tokens, chunk.generated)
            if chunk.token_ids and outcome.ttft is None and streamed:
                outcome.ttft = time.perf_counter() - started
            if job.logprobs is not None and chunk.log_probs is not None:
                outcome.token_ids.extend(chunk.token_ids)
                outcome.log_probs.extend(chunk.log_probs)
            text = "".join(push_token(t) for t in chunk.token_ids)
            delta = router.push(text) if text else ""
            if delta:
                outcome.pieces.append(delta)
                yield delta
            if router.stopped:
                outcome.finish_reason = "stop"
                outcome.stop_sequence = router.matched
                break
            if keep_alive is not None:
                now = time.monotonic()
                if delta:
                    quiet_since = now
                elif router.holding and now - quiet_since >= keep_alive:
                    quiet_since = now
                    yield KEEP_ALIVE
    delta = router.flush()
    if delta:
        outcome.pieces.append(delta)
        yield delta
    if outcome.finish_reason is None:
        outcome.finish_reason = "length" if outcome.completion_tokens >= job.max_new_tokens else "stop"
    held = router.held
    outcome.held[:] = [held] if held else []
    if tools is not None and held:
        forced = tools.mode == "forced"
        outcome.tool_calls = parse_forced(held, tools) if forced else parse_tool_calls(held, tools)[1]
        if outcome.tool_calls:
            # A block the output limit cut (no closing tag after it) is a call lost, not a finished answer:
            # "length" stays, as OpenAI answers cut output, with the calls that did parse (a forced call
            # that parses is whole; one that ends exactly at the limit after its close was not cut).
            cut = outcome.finish_reason == "length" and not forced and not held.rstrip().endswith(CALL_CLOSE)
            outcome.finish_reason = "length" if cut else "tool_calls"
        elif not forced:  # not a usable call after all (cut short, unknown function): it was content
            content = router.as_content(held)  # stop strings apply to it now
            if router.stopped:
                outcome.finish_reason, outcome.stop_sequence = "stop", router.matched
            if content:
                outcome.pieces.append(content)
                yield content
        # A forced call that does not parse (cut short by max_tokens) is never content: its
        # ``{"name": …, "arguments": …}`` wrapper is the guide's form, not the model's words, so the
        # answer is empty with the finish reason that cut it.


def _slow_engine(exc: BaseException) -> bool:
    """An engine failure the SLO guard counts against the pool (timed out, unavailable), not a refusal
    nor this gateway's own forced shutdown (``GatewayShuttingDown``, a kind of ``EngineUnavailable``)."""
    return isinstance(exc, EngineUnavailable) and not isinstance(exc, GatewayShuttingDown)


class CompletionRunner:
    """Runs :class:`CompletionJob` s against the injected admission, metrics and usage sink."""

    def __init__(self, *, admission: Admission, metrics: GatewayMetrics, usage: UsageSink,
                 selector_for: Callable[[PoolSnapshot], AdaptiveSelector] | None = None,
                 curves: MissRatioCurves | None = None,
                 clock: Callable[[], float] = time.monotonic, guard: SloGuards | None = None,
                 capture: CaptureSink | None = None, holds: ConversationHolds | None = None,
                 keep_alive: float = KEEP_ALIVE_SECONDS) -> None:
        self._admission = admission
        self._metrics = metrics
        self._usage = usage
        self._selector_for = selector_for
        self._curves = curves if curves is not None and curves.enabled else None
        self._clock = clock
        self._guard = guard
        self._capture = capture
        self.keep_alive = keep_alive  # a stream holding a tool call's text: a keep-alive this often (seconds)
        self._ledgers: dict[str, HintLedger] = {}  # pool -> live hinted blocks per tenant
        # Conversation and tool-loop holds (same budget as hints): the app factory's (services.holds),
        # which the Responses DELETE route reads too; a runner built alone (tests) gets its own.
        self.holds = holds if holds is not None else ConversationHolds()

    def _ledger(self, pool: str) -> HintLedger:
        ledger = self._ledgers.get(pool)
        if ledger is None:
            ledger = self._ledgers[pool] = HintLedger()
        return ledger

    async def run(self, job: CompletionJob, dialect: Dialect,
                  rate_headers: Callable[[RateLevels], dict[str, str]] = openai_rate_headers):
        """``rate_headers``: the dialect's rate-limit headers (admission.py), on the answer and on a 429."""
        tenant = job.tenant
        try:
            lease = await admit(self._admission, tenant, prompt_tokens=job.prompt.total,
                                max_output_tokens=job.max_new_tokens)
        except AdmissionError as exc:
            # No Retry-After on a request too large for its tokens per minute: it is never admissible as sent,
            # and it is a size refusal, not rate limiting (its own metric label).
            retry = exc.status == 503 or (exc.status == 429 and exc.admissible)
            too_large = exc.status == 429 and not exc.admissible
            self._metrics.rate_limited.labels(tenant.slug, "request_too_large" if too_large else exc.limit).inc()
            headers = refusal_headers(exc, rate_headers) if retry else None
            code = exc.code or ("rate_limit_exceeded" if exc.status == 429 else "limit_exceeded")
            raise ServingError(exc.status, code, str(exc), param=exc.limit, headers=headers) from exc
        job.max_new_tokens = lease.max_output_tokens  # a request naming none: the default admission reserved
        outcome = Outcome()
        try:  # until the engine call's own try blocks own the lease, a failure releases it (never served)
            selector = self._selector_for(job.tenant.pool) if self._selector_for is not None else None
            now = self._clock()
            adaptive = selector is not None and tenant.retention_mode == "adaptive" and not job.quota.over_quota
            hinting = hints_apply(job)
            holding = self.holds.applies(job)
            watched = not holding and self.holds.watches(tenant.pool.name)  # its hold duel sees every request
            ledger = self._ledger(tenant.pool.name)
            pinned = tenant.hints.enabled and ledger.has_pins(tenant.engine_tenant_id, now)
            # Hashed once per request: the router needs them too (passed on by _open).
            routed = isinstance(job.engine, RoutedEngine)
            hashes = (request_hashes(job) if routed or adaptive or hinting or holding or watched or pinned
                      or self._curves is not None else None)
            plan = build_plan(job, selector, now, hashes)
            started = time.perf_counter()
            # Read before this request's own hints are recorded: the latest use sets a block's hold.
            pins = ledger.pins(tenant.engine_tenant_id, hashes, now) if pinned and hashes is not None else ()
            if hinting:  # the client's hints, within its class and its hint budget
                outcome.hinted = hinted_plan(job, plan, hashes, ledger, now)
                plan = outcome.hinted.plan
            self._count_hints(job, outcome.hinted)
            if pins:  # an earlier hint's blocks this request reuses keep their hold (hint_quota.keep_pins)
                outcome.hinted = keep_pins(outcome.hinted or HintedPlan(plan), pins, tenant.hints,
                                           total=job.prompt.total, tokens_per_block=tenant.pool.tokens_per_block,
                                           hashes=hashes, ledger=ledger, tenant=tenant.engine_tenant_id, now=now)
                plan = outcome.hinted.plan
            if holding and hashes is not None:  # tools offered / a stored conversation: held for the measured gap
                outcome.conversation_hold = self.holds.plan(job, plan, hashes, ledger, now)
                plan = outcome.conversation_hold.plan
            elif watched and hashes is not None:
                self.holds.shadow(job, plan, hashes, ledger, now)
            if self._guard is not None:  # SLO guard tripped or pilot control arm: host tier rolled back
                plan, outcome.arm = self._guard.apply(tenant, plan)
            if self._curves is not None:
                # The plan the request really runs with (quota, adaptive bands, SLO rollback) goes to the shadows.
                self._curves.observe(tenant.pool, hashes, plan, now=now, num_tokens=job.prompt.total,
                                     tenant=tenant.engine_tenant_id)
            if isinstance(job.engine, RoutedEngine) and job.hints.cache_key is not None:
                # Any dialect's prompt_cache_key groups its requests on one replica (retention/routing/affinity.py).
                job.engine.keyed(tenant.tenant_id, job.hints.cache_key)
            request, chunks = _open(job, plan, hashes)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._admission.release_unserved(lease)
            self.holds.released(job, outcome.conversation_hold, self._clock())  # a hold planned: its count too
            raise
        receive = CLIENT_RECEIVE.get()
        if job.stream:
            primed = PrimedChunks(chunks)
            try:
                with UntilDisconnect(receive) as watch:  # the client may leave while the first token is awaited
                    await primed.prime()
                outcome.first_kv = primed.first.kv if primed.first is not None else None  # the engine served it
                if watch.gone:
                    raise _client_gone()
            except BaseException as exc:
                engine_failed = isinstance(exc, (EngineUnavailable, EngineRejected))
                outcome.status = "engine_error" if engine_failed else "client_gone"
                outcome.no_first_token = _slow_engine(exc) and request.streaming
                with anyio.CancelScope(shield=True):  # a cancelled request still releases its slot
                    await primed.aclose()
                    await self._finish(job, plan, outcome, started, lease)
                if engine_failed:
                    raise engine_error(exc, job) from exc
                raise
            if primed.first_at is not None and request.streaming:
                outcome.ttft = primed.first_at - started
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self._replica_header(job)}
            if lease.rate is not None:  # a tenant with rpm or tpm: the buckets as its decision left them
                headers.update(rate_headers(lease.rate))

            async def end() -> None:
                """From the body's ``finally`` or, if the body never ran, the response's (once)."""
                if outcome.status == "ok" and outcome.finish_reason is None:
                    outcome.status = "client_gone"  # the body never ran to its end
                await primed.aclose()  # no-op when _generate closed it; frees the engine request otherwise
                await self._finish(job, plan, outcome, started, lease)

            end_stream = run_once_shielded(end)
            return ClosingStreamingResponse(self._stream(job, dialect, request, primed, outcome, started, end_stream),
                                            on_close=end_stream, media_type="text/event-stream", headers=headers)
        try:
            with UntilDisconnect(receive) as watch:  # the client may leave before its answer is whole
                while True:
                    try:
                        async for _ in _generate(job, request, chunks, outcome, started):
                            pass
                        break
                    except EngineRestart:  # its replica failed mid-answer; nothing was sent: run it again
                        outcome = _restarted(outcome)
                        chunks = _chunks(job, request, hashes)
            if watch.gone and outcome.finish_reason is None:
                outcome.status = "client_gone"
                raise _client_gone()
        except (EngineUnavailable, EngineRejected) as exc:
            outcome.status = "engine_error"
            outcome.no_first_token = _slow_engine(exc) and request.streaming and outcome.ttft is None
            raise engine_error(exc, job) from exc
        finally:
            with anyio.CancelScope(shield=True):  # a client gone mid-answer still releases its slot
                await self._finish(job, plan, outcome, started, lease)
        headers = self._replica_header(job)
        if lease.rate is not None:
            headers.update(rate_headers(lease.rate))
        return JSONResponse(dialect.body(job, outcome), headers=headers or None)

    def _count_hints(self, job: CompletionJob, hinted: HintedPlan | None) -> None:
        hints = job.hints
        if not hints.breakpoints and hints.retention != "24h":
            return  # nothing that could change a plan (no hint, "in_memory", a key alone)
        tenant = job.tenant
        if hinted is None or (not hinted.hashes and not hinted.clipped):
            outcome = "ignored"  # the class does not honour hints, or the plan was demoted
        elif hinted.clipped:
            outcome = "clipped" if hinted.hashes else "no_room"
        else:
            outcome = "applied"
        self._metrics.cache_hints.labels(tenant.slug, tenant.pool.name, outcome).inc()
        if hinted is not None and hinted.hashes:
            self._metrics.hinted_blocks.labels(tenant.slug, tenant.pool.name).inc(len(hinted.hashes))

    @staticmethod
    def _replica_header(job: CompletionJob) -> dict[str, str]:
        """Like x-gateway-destination-endpoint of the Gateway API Inference Extension
        (kubernetes-sigs/gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol):
        which engine replica serves the answer, named as in the registry (not an address).
        Read once the engine's first chunk is in (the routed engine no longer retries then)."""
        replica = getattr(job.engine, "replica", None)
        return {REPLICA_HEADER: replica} if replica else {}

    async def _finish(self, job, plan, outcome: Outcome, started: float, lease) -> None:
        await self._admission.release(lease, completion_tokens=outcome.completion_tokens)
        tenant = job.tenant
        hinted = outcome.hinted
        if hinted is not None and (hinted.hashes or hinted.kept_hashes):
            # TensorRT-LLM starts a block's duration when the request releases it: count from now.
            ledger, released = self._ledger(tenant.pool.name), self._clock()
            if hinted.hashes:
                ledger.record(tenant.engine_tenant_id, hinted.hashes, hinted.durations_ms, released,
                              windows_ms=hinted.windows_ms)
            if hinted.kept_hashes:  # an earlier hint's pins this request re-told the engine: no new promise
                ledger.record(tenant.engine_tenant_id, hinted.kept_hashes, hinted.kept_durations_ms, released,
                              promise=False)
        self.holds.released(job, outcome.conversation_hold, self._clock())
        latency = time.perf_counter() - started
        # Mean inter-token latency: observable only when tokens were streamed one by one.
        inter_token = None
        if outcome.ttft is not None and outcome.completion_tokens > 1:
            inter_token = (latency - outcome.ttft) / (outcome.completion_tokens - 1)
        self._metrics.observe_request(
            tenant=tenant.slug, tenant_id=tenant.tenant_id, pool=tenant.pool.name, status=outcome.status,
            prompt_tokens=job.prompt.total, completion_tokens=outcome.completion_tokens, ttft=outcome.ttft,
            latency=latency, kv=outcome.kv, demoted=plan.demoted, inter_token=inter_token,
        )
        if self._guard is not None:
            ttft = latency if outcome.no_first_token else outcome.ttft  # at least the first-token deadline
            self._guard.observe(tenant.pool.name, outcome.arm, ttft=ttft, inter_token=inter_token, kv=outcome.kv)
        # Billing: a request whose answer the client did not get (503/504 instead of it; the client is told to retry)
        # is not usage, whatever the engine generated before failing, nor one no engine served (its client left
        # before the engine's first response). A stream that failed after its start is billed what it sent.
        unserved = outcome.kv is None and outcome.first_kv is None and not outcome.completion_tokens
        if outcome.status == "ok" or (outcome.status == "client_gone" and not unserved) or \
                (job.stream and outcome.completion_tokens):
            cache = cache_usage(job, outcome)  # of the prompt: read from cache, kept under a hint for 5 m, 1 h
            durable = self._usage(tenant.tenant_id, job.prompt.total, outcome.completion_tokens, *cache)
            if durable is not None:
                await durable
        if self._capture is not None and outcome.kv is not None:  # the engine ran it: a trace line (if sampled)
            kv = outcome.kv
            self._capture(tenant_id=tenant.tenant_id, tenant=tenant.slug, retention_class=tenant.retention_class,
                          pool=tenant.pool.name, tokens_per_block=tenant.pool.tokens_per_block, salt=tenant.engine_salt,
                          input_ids=job.prompt.input_ids, system_end=job.prompt.system_end,
                          context_end=job.prompt.context_end, output_length=outcome.completion_tokens,
                          reused_blocks=kv.reused_blocks, onboarded_blocks=kv.onboarded_blocks, ttft=outcome.ttft,
                          latency=latency, status=outcome.status, hints=job.hints,
                          turn_ends=job.tokenizer.stop_token_ids if job.kind == "chat" else ())

    async def _stream(self, job: CompletionJob, dialect: Dialect, request: EngineRequest, chunks: PrimedChunks,
                      outcome: Outcome, started: float, end: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        """The SSE body the dialect renders; ``end`` (idempotent: closes ``chunks``, releases
        the admission slot, records the outcome) runs when it ends, and from the response if
        it never starts. Once generation is over, the closing frames (finish reason, usage,
        ``[DONE]``, or the error event) are held until ``end`` has run: the usage is durable
        (journal fsynced) before the client sees the end of its answer; content frames are
        never held."""
        trailer: list[bytes] = []
        try:
            keep_alive = self.keep_alive if getattr(dialect, "keeps_alive", False) else None
            async for frame in dialect.stream(job, outcome, _deltas(job, request, chunks, outcome, started, keep_alive)):
                if outcome.finish_reason is None and outcome.status == "ok":
                    yield frame
                else:  # generation over: the closing frames wait until the usage is durable
                    trailer.append(frame)
            await end()
            if trailer:  # one message, the body's last: fewer socket writes, same bytes
                yield LastFrame(b"".join(trailer))
        except BaseException:
            if outcome.status == "ok":
                outcome.status = "client_gone"
            raise
        finally:
            await end()


async def _deltas(job: CompletionJob, request: EngineRequest, chunks: AsyncIterator[EngineChunk], outcome: Outcome,
                  started: float, keep_alive: float | None = None) -> AsyncIterator[str]:
    """:func:`_generate` for a dialect's stream: an engine failure becomes the
    :class:`ServingError` the dialect renders (and the outcome's status)."""
    generate = _generate(job, request, chunks, outcome, started, keep_alive)
    try:
        async for delta in generate:
            yield delta
    except (EngineUnavailable, EngineRejected) as exc:
        outcome.status = "engine_error"
        raise engine_error(exc, job) from exc
    finally:
        await generate.aclose()


def cached_tokens(job: CompletionJob, outcome: Outcome, kv: KvMetrics | None = None) -> int:
    """Prompt tokens served from KV (``engines.contract.cached_prompt_tokens``), from ``kv`` if
    given, else from the outcome's latest engine response."""
    kv = kv if kv is not None else outcome.kv
    if kv is None:
        return 0
    return cached_prompt_tokens(kv.reused_blocks, job.prompt.total, job.tenant.pool.tokens_per_block)


def cache_usage(job: CompletionJob, outcome: Outcome) -> tuple[int, int, int]:
    """(read, written 5m, written 1h) prompt tokens in any dialect, together at most the prompt: what Messages
    reports and the usage ledger bills (KV metrics: the latest engine response's, else a stream's first)."""
    read = cached_tokens(job, outcome, outcome.kv if outcome.kv is not None else outcome.first_kv)
    return read, *cache_creation(outcome.hinted, read, job.tenant.pool.tokens_per_block)
