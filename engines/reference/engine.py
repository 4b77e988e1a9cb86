"""The reference engine: one background thread stepping the scheduler and the model.

Threads::

    callers (asyncio / gRPC)            engine thread
    submit()/cancel()/stats()  --lock-->  schedule (pool)  -> forward (no lock) -> sample, emit (lock)
           ^                                                                        |
           +------------------- sink(EngineOutput), called on the engine thread ----+

The lock guards the scheduler and the pool; the forward runs outside it so the stats
call and new submissions never wait for a long prefill. Cancellation is recorded under
the lock and carried out by the engine thread between steps, so a sequence is never
released while a forward is writing its blocks.

Invariants: every submitted request gets exactly one output with ``finished=True``
(end token, length, cancel, or error); after it, the request holds no pool blocks. A
request held by the fault knob ``fault_first_token_hold_ms`` is in flight but not in the
scheduler (it holds no blocks) until its hold ends or it is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from engines.contract import (END_ID, INPUT_IDS, REQUEST_OUTPUT_LEN, ContractError, EngineRequest, KvMetrics,
                              TokenLogProbs, check_combinations)
from engines.refusals import output_out_of_range, too_long
from engines.pool_stats import PoolStatsReport, TierStats
from engines.kv_events import KvEventLog, PoolEventFeed
from engines.reference.config import SMALL_STEP_ROWS, ReferenceEngineConfig
from engines.reference.kv_cache import PagedKvCache
from engines.reference.loader import ModelBundle
from engines.reference.runner import StepRunner
from engines.reference.grammar import GrammarCache
from engines.reference.sampling import Sampled, make_generator
from engines.reference.scheduler import FinishReason, Scheduler, Sequence
from retention.pool import BlockPool, PoolConfig

log = logging.getLogger(__name__)
# Loop iterations failing in a row (outside the per-step guards) before the engine stops itself.
_MAX_LOOP_FAILURES = 3


@dataclass(frozen=True, slots=True)
class EngineOutput:
    request_id: str
    new_tokens: tuple[int, ...]
    sequence_length: int  # tokens generated so far (cumulative, end token excluded)
    kv: KvMetrics
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    log_probs: tuple[TokenLogProbs, ...] | None = None  # one per token of new_tokens, when asked


Sink = Callable[[EngineOutput], None]


class DuplicateRequestError(ValueError):
    """A request id that is still in flight was submitted again."""


class EngineStoppedError(RuntimeError):
    """The engine is not running."""


class ReferenceEngine:
    def __init__(self, bundle: ModelBundle, config: ReferenceEngineConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.bundle = bundle
        self.config = config
        self.clock = clock
        self.pool = BlockPool(
            PoolConfig(
                primary_blocks=config.primary_blocks,
                secondary_blocks=config.secondary_blocks,
                tokens_per_block=config.tokens_per_block,
                secondary_offload_min_priority=config.secondary_offload_min_priority,
                enable_block_reuse=config.enable_block_reuse,
            )
        )
        self.cache = PagedKvCache(
            bundle.geometry(config.tokens_per_block), config.kv_dtype,
            primary_blocks=config.primary_blocks, secondary_blocks=config.secondary_blocks,
            scales=bundle.kv_scales(config.kv_dtype), compute_dtype=bundle.model.dtype,
        )
        self.scheduler = Scheduler(
            self.pool, tokens_per_block=config.tokens_per_block,
            max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
            policy=config.scheduler_policy,
        )
        self.runner = StepRunner(bundle.model, self.cache, onboard_delay_s=config.fault_onboard_delay_ms / 1000)
        self.grammars = GrammarCache(bundle.tokenizer, bundle.config.vocab_size)
        # KV events for routers (engines/kv_events.py): the pool's events are drained into
        # the ring after every step, so the pool's own buffer never grows without bound.
        self.kv_events = KvEventLog(self._cached_tiers, capacity=config.kv_event_ring)
        self._event_feed = PoolEventFeed(self.kv_events)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sinks: dict[str, Sink] = {}
        self._cancels: set[str] = set()
        # Fault knob (config.fault_first_token_hold_ms): request id -> (release time or None, sequence).
        self._held: dict[str, tuple[float | None, Sequence]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        # Set when the engine thread ended without stop(): it gave up after internal errors or
        # died. ServerLive then answers not live, so an orchestrator restarts the process.
        self.failed = False

    @property
    def vocab_size(self) -> int:
        return self.bundle.config.vocab_size

    # Lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvgate-reference-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping; in-flight requests end with ``FinishReason.CANCELLED``."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            now = self.clock()
            for request_id in list(self._held):
                self._drop_held(request_id)
            for request_id in list(self._sinks):
                seq = self.scheduler.find(request_id)
                if seq is not None:
                    self._finish(seq, FinishReason.CANCELLED, now)

    # Requests -----------------------------------------------------------------------------
    def compile_guide(self, request: EngineRequest) -> Any:
        """The request's compiled grammar (cached per guide), None without a guide; ContractError if it does not compile
        or the request combines fields the contract refuses (engines.contract.check_combinations)."""
        self._check(request)
        return None if request.guide is None else self.grammars.compile(request.guide)

    def _check(self, request: EngineRequest) -> None:
        """The contract's refusals for in-process callers too: field combinations
        (engines.contract.check_combinations) and an end id outside the vocabulary (parse_request's)."""
        check_combinations(request)
        # The input and output limits parse_request enforces (config.py guarantees their sum fits
        # the pool): without them a request that can never fit would wait at the head of the
        # queue for good under guaranteed_no_evict, and every request behind it with it.
        limits = self.config
        if len(request.input_ids) > limits.max_input_len:
            raise ContractError(too_long(len(request.input_ids), limits.max_input_len), tensor=INPUT_IDS.name)
        if not 1 <= request.max_new_tokens <= limits.max_output_len:
            raise ContractError(output_out_of_range(limits.max_output_len, request.max_new_tokens),
                                tensor=REQUEST_OUTPUT_LEN.name)
        if request.end_id is not None and request.end_id >= self.vocab_size:  # negative: no end id
            raise ContractError(f"end_id must be a token id in [0, {self.vocab_size}) or -1 (none), got {request.end_id}",
                                tensor=END_ID.name)

    def submit(self, request_id: str, request: EngineRequest, sink: Sink, *, compiled: Any = None) -> None:
        # No end_id (absent or -1) or ignore_eos: run to request_output_len, as TensorRT-LLM
        # does with end_id -1 (tensorrt_llm/executor/base_worker.py: end_id=-1 if ignore_eos).
        self._check(request)  # the contract's refusals hold for in-process callers too
        end_ids = frozenset({request.end_id}) if request.end_id is not None and not request.ignore_eos else frozenset()
        if request.guide is not None and compiled is None:
            compiled = self.compile_guide(request)
        matcher = None
        if compiled is not None:
            matcher = self.grammars.matcher(compiled, request.end_id)
        seq = Sequence(
            request_id=request_id, request=request, tokens=list(request.input_ids),
            prompt_len=len(request.input_ids), end_ids=end_ids, generator=make_generator(request.sampling),
            matcher=matcher,
        )
        with self._lock:
            if not self.is_running():  # a dead thread would never answer: refuse (UNAVAILABLE)
                raise EngineStoppedError("the reference engine is not running")
            if request_id in self._sinks:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._sinks[request_id] = sink
            hold_ms = self.config.fault_first_token_hold_ms
            if hold_ms:
                self._held[request_id] = (None if hold_ms < 0 else self.clock() + hold_ms / 1000, seq)
            else:
                self.scheduler.add(seq)
            self._wake.notify()

    def cancel(self, request_id: str) -> bool:
        """Ask the engine to end ``request_id``; False when it is not in flight."""
        with self._lock:
            if request_id not in self._sinks:
                return False
            self._cancels.add(request_id)
            self._wake.notify()
            return True

    async def generate(self, request_id: str, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Outputs of one request as they are produced; closing the iterator cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        # A first compile of a schema takes milliseconds to seconds: off the event loop.
        compiled = await asyncio.to_thread(self.compile_guide, request) if request.guide is not None else None
        self.submit(request_id, request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), compiled=compiled)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.cancel(request_id)

    def is_running(self) -> bool:
        """True while the engine thread is alive and not stopping (ServerReady, ModelReady)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping

    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def stats(self, events_since: int | None = None) -> PoolStatsReport:
        """Pool statistics; with ``events_since`` also the KV events after that cursor."""
        with self._lock:
            report = self._stats_locked()
            if events_since is not None:
                self._pump_events()
                report.kv_events = self.kv_events.report(events_since)
            return report

    def _cached_tiers(self) -> dict[int, int]:
        """Every cached block hash -> tier (the resync snapshot; called under the lock)."""
        return {h: int(block.tier) for h, block in self.pool.cached_blocks().items()}

    def _pump_events(self) -> None:
        self._event_feed.feed(self.pool.take_events())

    def _stats_locked(self) -> PoolStatsReport:
        s = self.pool.stats()
        return PoolStatsReport(
            tokens_per_block=s.tokens_per_block,
            primary=TierStats(s.max_num_blocks, s.free_num_blocks, s.used_num_blocks),
            secondary=TierStats(s.secondary_max_blocks, s.secondary_free_blocks, s.secondary_used_blocks),
            reused_blocks=s.reused_blocks,
            missed_blocks=s.missed_blocks,
            alloc_total_blocks=s.alloc_total_blocks,
            alloc_new_blocks=s.alloc_new_blocks,
            offloaded_blocks=s.offloaded_blocks,
            onboarded_blocks=s.onboarded_blocks,
            evicted_blocks=s.evicted_blocks,
            cache_hit_rate=s.cache_hit_rate,
            secondary_offload_min_priority=self.config.secondary_offload_min_priority,
            tenants={str(t): [int(p), int(h)] for t, (p, h) in self.pool.tenant_blocks().items() if t is not None},
        )

    # Engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        """Step until stopped. An unexpected exception in an iteration fails the requests in
        flight (each still gets its final output) and the loop goes on; after
        ``_MAX_LOOP_FAILURES`` failed iterations in a row the state is taken as corrupt and the
        engine stops itself, so no request is ever left waiting on a thread that is gone."""
        failures = 0
        try:
            while True:
                try:  # one try per iteration, not per token: the hot path pays nothing
                    if not self._iterate():
                        return
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad iteration
                    failures += 1
                    log.exception("reference engine loop failed (%d in a row)", failures)
                    with self._lock:
                        self._cancels.clear()  # their requests are failed below
                        self._fail_all(f"engine loop failed: {exc}", self.clock())
                        # The pool's events of the failed step may be lost (taken, never fed):
                        # every poller resyncs from a snapshot rather than keep a drifted index.
                        self.kv_events.invalidate()
                    if failures >= _MAX_LOOP_FAILURES:
                        return
        finally:
            with self._lock:
                if not self._stopping:  # gave up or died: refuse new work, answer what is left
                    log.error("reference engine stopped itself after internal errors")
                    self._stopping = self.failed = True
                    self._fail_all("the reference engine stopped after internal errors", self.clock())

    def _iterate(self) -> bool:
        """One scheduling step (or a wait for work); False once the engine is stopping."""
        with self._lock:
            while not self._stopping and not (self._release_held() or self.scheduler.has_work() or self._cancels):
                self._wake.wait(self._held_wait())
            if self._stopping:
                return False
            now = self.clock()
            self._apply_cancels(now)
            try:
                step = self.scheduler.schedule(now)
            except Exception as exc:  # a pool/scheduler bug fails the requests, not the engine
                log.exception("reference engine scheduling failed")
                self._fail_all(f"engine scheduling failed: {exc}", now)
                return True
            if not step:
                # Work is queued but nothing fits (cannot happen with a validated config
                # and no running sequence); wait for a release or a cancel.
                self._wake.wait(0.05)
                return True
        rows = len(step.decodes) + sum(w.length for w in step.prefills)
        torch.set_num_threads(self.config.num_threads if rows > SMALL_STEP_ROWS else self.config.decode_threads)
        try:
            results = self.runner.run(step)
        except Exception as exc:  # the forward failed: fail the step's requests, not the engine
            # (a failure of one row's sampling or acceptance fails that row only: sampling.sample,
            # _accept_isolated)
            log.exception("reference engine step failed")
            with self._lock:
                now = self.clock()
                for work in (*step.decodes, *step.prefills):
                    if work.seq.request_id in self._sinks:
                        self._fail_one(work.seq, f"engine step failed: {exc}", now)
            return True
        with self._lock:
            self.steps += 1
            now = self.clock()
            try:
                self.scheduler.store_computed(step)
            except Exception:  # storing for reuse is an optimisation: a bug must not fail the step
                log.exception("reference engine: storing computed blocks failed")
            for seq, sampled in results:
                if seq.request_id in self._sinks and seq.request_id not in self._cancels:
                    self._accept_isolated(seq, sampled, now)
            self._pump_events()
        return True

    def _fail_all(self, message: str, now: float) -> None:
        """End every request in flight with ``message`` (held ones too). A request whose
        sequence cannot be found or released is still answered: its sink is never dropped."""
        for request_id in list(self._sinks):
            held = self._held.pop(request_id, None)
            try:
                seq = held[1] if held is not None else self.scheduler.find(request_id)
            except Exception:  # noqa: BLE001 - answer the client whatever the bookkeeping says
                log.exception("reference engine: finding request %s failed", request_id)
                seq = None
            if seq is not None and held is None:
                self._fail_one(seq, message, now)
                continue
            sink = self._sinks.pop(request_id)
            self._wake.notify_all()
            generated, metrics = (seq.generated, seq.metrics) if seq is not None else (0, KvMetrics())
            self._safe_call(sink, EngineOutput(request_id, (), generated, metrics, True, None, message))

    def _apply_cancels(self, now: float) -> None:
        for request_id in self._cancels:
            if request_id in self._held:
                self._drop_held(request_id)
                continue
            seq = self.scheduler.find(request_id)
            if seq is not None:
                self._finish(seq, FinishReason.CANCELLED, now)
        self._cancels.clear()

    # Fault knob: held requests (config.fault_first_token_hold_ms) ------------------------
    def _release_held(self) -> bool:
        """Move held requests whose hold has ended into the scheduler; True if any moved."""
        if not self._held:
            return False
        now = self.clock()
        due = [rid for rid, (until, _) in self._held.items() if until is not None and until <= now]
        for request_id in due:
            self.scheduler.add(self._held.pop(request_id)[1])
        return bool(due)

    def _held_wait(self) -> float | None:
        """Seconds until the next held request is due (None: nothing timed is held)."""
        times = [until for until, _ in self._held.values() if until is not None]
        return max(0.0, min(times) - self.clock()) if times else None

    def _drop_held(self, request_id: str) -> None:
        """End a held request as cancelled (it was never scheduled: no blocks to release)."""
        _, seq = self._held.pop(request_id)
        sink = self._sinks.pop(request_id, None)
        self._wake.notify_all()
        if sink is not None:
            self._safe_call(sink, EngineOutput(request_id, (), 0, seq.metrics, True, FinishReason.CANCELLED))

    def _accept_isolated(self, seq: Sequence, sampled: Sampled, now: float) -> None:
        """Accept one sampled row; a failure there (a row the sampler could not sample, a grammar
        matcher that raises) fails that sequence only, never the step's other requests."""
        try:
            if sampled.error is not None:
                self._finish(seq, None, now, error=sampled.error)
            else:
                self._accept(seq, sampled, now)
        except Exception as exc:  # noqa: BLE001 - one sequence's bug must not fail its neighbours
            log.exception("reference engine: request %s failed", seq.request_id)
            if seq.request_id in self._sinks:
                self._fail_one(seq, f"engine step failed: {exc}", now)

    def _fail_one(self, seq: Sequence, message: str, now: float) -> None:
        try:
            self._finish(seq, None, now, error=message)
        except Exception:  # the pool is in an unknown state; still answer the client
            log.exception("reference engine: finishing request %s failed", seq.request_id)
            self.scheduler.running = [s for s in self.scheduler.running if s is not seq]
            sink = self._sinks.pop(seq.request_id, None)
            self._wake.notify_all()
            if sink is not None:
                self._safe_call(sink, EngineOutput(seq.request_id, (), seq.generated, seq.metrics, True, None, message))

    def _accept(self, seq: Sequence, sampled: Sampled, now: float) -> None:
        token = sampled.token
        if seq.matcher is not None:
            # The bitmask allowed only tokens the grammar accepts; a stop token it accepts
            # completes the guide and ends the request (ignore_eos with a guide is refused).
            if not seq.matcher.accept_token(token):
                self._finish(seq, None, now, error=f"guided decoding: the grammar refused token {token}")
                return
            if seq.matcher.is_terminated():
                self._finish(seq, FinishReason.END_ID, now)
                return
        if token in seq.end_ids:
            self._finish(seq, FinishReason.END_ID, now)
            return
        seq.tokens.append(token)
        seq.generated += 1
        if sampled.log_probs is not None:
            seq.log_probs.append(sampled.log_probs)
        last_lp = (sampled.log_probs,) if sampled.log_probs is not None else None
        if seq.generated >= seq.request.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH, now, last=(token,), last_log_probs=last_lp)
        elif seq.request.streaming:
            self._emit(seq, EngineOutput(seq.request_id, (token,), seq.generated, seq.metrics, log_probs=last_lp))

    def _finish(self, seq: Sequence, reason: FinishReason | None, now: float, *, last: tuple[int, ...] = (),
                error: str | None = None, last_log_probs: tuple[TokenLogProbs, ...] | None = None) -> None:
        self.scheduler.finish(seq, now)
        if seq.request.streaming:
            tokens = last
            log_probs = (last_log_probs or ()) if seq.request.return_log_probs else None
        else:
            tokens = tuple(seq.tokens[seq.prompt_len :])
            log_probs = tuple(seq.log_probs) if seq.request.return_log_probs else None
        output = EngineOutput(seq.request_id, tokens, seq.generated, seq.metrics, True, reason, error, log_probs)
        sink = self._sinks.pop(seq.request_id, None)
        self._wake.notify_all()
        if sink is not None:
            self._safe_call(sink, output)

    def _emit(self, seq: Sequence, output: EngineOutput) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is not None:
            self._safe_call(sink, output)

    @staticmethod
    def _safe_call(sink: Sink, output: EngineOutput) -> None:
        try:
            sink(output)
        except Exception:  # a closed event loop must not take the engine thread down
            log.exception("reference engine output sink failed")
