"""Triton Python-backend model ``kvgate_llm`` around the TensorRT-LLM release/1.2 executor.

Why not the stock ``tensorrt_llm`` C++ model: it has no config key for
``secondary_offload_min_priority``, no KV event buffer and no cache salt, and its ensemble
does not declare the ``retention_*`` inputs (DESIGN §4). This model is decoupled (many
responses per request) and speaks exactly ``engines/contract.py``:

    execute(requests) ──parse_request──▶ executor.enqueue_request(Request(...))
         │                                        │
         └─ kv_stats call ─▶ PoolStatsReport      ▼
                                  response thread: await_responses → sender.send(...)
                                                   is_cancelled → cancel_request
                                                   get_latest_events → TenantBlockLedger

Request parsing and validation is ``engines.contract.parse_request`` — the same function
the CPU reference engine calls. Binding calls cite their source: ``cpp/tensorrt_llm/
nanobind/executor/{executor,request,executorConfig,bindings}.cpp`` (1.2-era TensorRT-LLM
snapshots; see :mod:`engines.trtllm.bindings` for what could not be read at the tag).
Python-backend names were read in triton-inference-server/python_backend branch r26.04
(47f9e030): ``src/resources/triton_python_backend_utils.py`` (``get_input_tensor_by_name``,
``using_decoupled_model_transaction_policy``, ``TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1``)
and ``src/pb_stub.cc`` (``Tensor(name, ndarray)``/``as_numpy``, ``InferenceResponse(
output_tensors=, error=)``, ``TritonError``, ``TritonModelException``, request
``request_id()``/``get_response_sender()``, sender ``send(response=None, flags=0)``/
``is_cancelled()``).

Multi-GPU engines run the executor in orchestrator mode; the orchestrator process holds no
model, so ``get_kv_cache_event_manager()`` returns None there (executorImpl.cpp:
``if (!mModel) return std::nullopt``). The model then serves without KV events: no
per-tenant block counts, no host-tier counts (logged once at start-up, documented).

At start-up the model reads the engine's ``config.json`` and refuses to load when the pool
promises block reuse but the engine has no paged context FMHA (the executor would only log
"KV cache reuse disabled ..." and serve without reuse) or was built for another block size:
:mod:`engines.trtllm.engine_config`.

Every request gets exactly one response with the FINAL flag, a cancelled one too (python_backend
README r26.04: the flag "is still needed even the request is cancelled"): a client that goes away
is cancelled in the executor and keeps its entry until the executor's final CANCELLED response
(executorImpl.cpp ``terminateCancelledRequests``), which is forwarded with the flag. Which thread
sends a request's final answer (the response thread, or the execute thread for a ``stop``) is
decided under the model's lock (``_Pending.closed``); one failed send never costs the rest of an
``await_responses`` batch its answers. KV events are fetched and applied in one critical section:
the response thread and the stats call both drain them, and each gets its own batch.

The executor runs with chunked context: the spec allows ``max_num_tokens < max_input_len``, and
without it TensorRT-LLM would refuse prompts over ``max_num_tokens`` (batch_manager/trtGptModel.h);
an engine that cannot chunk (no paged context FMHA) is refused at start-up when the spec needs it.

Per-request ``kv_cache_onboarded_blocks`` is derived: TensorRT-LLM 1.2's ``KvCacheMetrics`` has no
onboard count (request.cpp), but its ``num_total_allocated_blocks`` is the request's ``getFreeBlock``
calls during ``KVCacheManager::addSequence`` (kvCacheManager.cpp, NVIDIA/TensorRT-LLM 002ba6a7: only
``getFreeBlock`` does ``++mAllocTotalBlocks``; a prompt block that misses takes one, a matched block
already on the GPU none, an onboard one, ``onboardBlock``: "auto block = getFreeBlock();
mTransferManager->onboard(...)"), so onboarded = total − missed (see :meth:`TritonPythonModel._kv_metrics`).
Pool-level onboards come from KV events and are reported by the stats call.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend stub

from engines import contract, pool_stats, refusals, response_tensors
from engines.kv_events import KvEventsReport
from engines.trtllm import bindings, engine_config, executor_args, request_extensions
from engines.trtllm.kv_event_translator import KvEventTranslator
from engines.trtllm.kv_ledger import TenantBlockLedger
from engines.triton.params import ServingParams

log = logging.getLogger("kvgate.triton")


@dataclass(slots=True)
class _Pending:
    """A request between enqueue and its final answer.

    ``closed``: its final answer is claimed (set under the model's lock, in the same critical section
    that drops the entry and queues the finished request for the ledger, so exactly one thread sends
    the final flag and the bookkeeping runs once). ``send_lock``: every send to the sender happens
    under it, after checking ``closed``, so nothing follows the final flag (python_backend
    response_sender.cc refuses: "Response sender has been closed."). Lock order: ``send_lock``, then
    the model's lock. ``cancel_requested``: the client went away and ``cancel_request`` was called;
    the entry stays until the executor's final response (executorImpl.cpp terminateCancelledRequests).
    """

    sender: Any
    request: contract.EngineRequest
    end_id: int | None
    triton_id: str
    generated: int = 0
    closed: bool = False
    cancel_requested: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)


def _error(message: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


def _tensors(arrays: dict[str, np.ndarray]) -> list[Any]:
    return [pb_utils.Tensor(name, value) for name, value in arrays.items()]


class TritonPythonModel:
    """Triton instantiates this class once per model instance (python_backend README)."""

    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("kvgate_llm must be decoupled: set model_transaction_policy { decoupled: true }")
        self.params = ServingParams.from_model_config(model_config)
        self.trtllm = bindings.load_executor_bindings()
        version = bindings.check_version(self.trtllm, self.params.tensorrt_llm_version)
        if version is None:
            log.warning("%s has no __version__; cannot check it against the spec's TensorRT-LLM %s",
                        bindings.EXECUTOR_MODULE, self.params.tensorrt_llm_version)
        try:
            # A pool promises block reuse; TensorRT-LLM silently runs without it on an engine built
            # without paged context FMHA (engines/trtllm/engine_config.py has the sources). Refuse here.
            facts = engine_config.read_engine_config(self.params.engine_dir)
            engine_config.check_reuse(
                facts, enable_block_reuse=self.params.enable_block_reuse, tokens_per_block=self.params.tokens_per_block
            )
            # Prompts over max_num_tokens need chunked context, which the executor drops on this engine.
            engine_config.check_chunked_context(
                facts, max_input_len=self.params.max_input_len, max_num_tokens=self.params.max_num_tokens
            )
            # Token ids and logit biases are sized by the spec's vocabulary: it must be the engine's.
            engine_config.check_vocabulary(facts, vocab_size=self.params.vocab_size)
        except engine_config.EngineConfigError as exc:
            raise pb_utils.TritonModelException(f"kvgate_llm: {exc}") from exc
        # embedding_bias in the engine's logits dtype and vocabulary (createNewDecoderRequests.cpp).
        self.bias_layout = engine_config.bias_layout(facts)
        if self.bias_layout.refusal is not None:
            log.error("kvgate_llm: requests with a logit bias will be refused: %s", self.bias_layout.refusal)
        # One representative retention config (two ranges, an open end, a duration, decode retention), built
        # once: a binding that refuses what retention_config sends stops the load with a BindingError naming
        # it, instead of failing every retained request (executor_args.check_retention_binding).
        executor_args.check_retention_binding(self.trtllm)
        self.salt_supported = bindings.probe_cache_salt(self.trtllm)
        if not self.salt_supported:
            log.error(
                "TensorRT-LLM executor Request has no cache_salt_id: requests carrying cache_salt will be REFUSED "
                "(salted tenants cannot be isolated on this build)"
            )
        # Guided decoding needs the tokenizer in the executor (GuidedDecodingConfig); the stock
        # models read it from the `tokenizer_dir` parameter (tensorrt_llm/config.pbtxt), as here.
        # The renderer writes it from the spec (engines/triton/params.py); a pool rendered with
        # none refuses guided requests by name (request_extensions.py).
        tokenizer_dir = self.params.tokenizer_dir
        guided_config = None
        if tokenizer_dir:
            stops = [self.params.end_id] if self.params.end_id is not None else []
            try:
                guided_config = request_extensions.guided_decoding_config(self.trtllm, tokenizer_dir, stops)
            except (OSError, ValueError, KeyError) as exc:
                raise pb_utils.TritonModelException(
                    f"kvgate_llm: tokenizer_dir {tokenizer_dir!r} has no usable tokenizer.json ({exc}); guided "
                    "decoding needs it (the engine builder saves it under /engines/tokenizers/<spec>)") from exc
        else:
            log.error("kvgate_llm: no tokenizer_dir: guided requests (response_format, forced tool calls) will be refused")
        self.guided_supported = guided_config is not None
        self.executor = executor_args.make_executor(self.trtllm, self.params, guided_decoding_config=guided_config)
        if not self.executor.can_enqueue_requests():  # executor.cpp: can_enqueue_requests()
            # Leader mode on a non-leader rank: kvgate runs multi-GPU engines in orchestrator
            # mode (one process enqueues), so this is a launch error, not a state to serve in.
            self.executor.shutdown()
            raise pb_utils.TritonModelException("kvgate_llm: this executor rank cannot enqueue requests (launch Triton once, not under mpirun)")
        # executor.cpp: get_kv_cache_event_manager() -> Optional[KVCacheEventManager]. None only in
        # an orchestrator process (world size > 1: no local model, executorImpl.cpp
        # getKVCacheEventManager); with event_buffer_max_size 0 a manager exists but its events never
        # arrive — the spec requires a non-zero buffer for that reason.
        self.event_manager = self.executor.get_kv_cache_event_manager()
        if self.event_manager is None:
            log.error(
                "kvgate_llm: this executor exposes no KV cache events (orchestrator mode, world size %d): "
                "per-tenant and host-tier block counts will not be reported for this pool",
                self.params.world_size,
            )
        self.ledger = TenantBlockLedger(tokens_per_block=self.params.tokens_per_block)
        # Routers read KV events in kvgate's hash space (engines/trtllm/kv_event_translator.py);
        # without an event manager the gateway falls back to approximate routing.
        self.kv_events = KvEventTranslator(self.params.tokens_per_block) if self.event_manager is not None else None
        self.lock = threading.Lock()
        self.pending: dict[int, _Pending] = {}
        # Finished requests, dropped from the ledger's pending roots after the next event drain.
        self.finished: list[contract.EngineRequest] = []
        self.latest_kv_stats: Any = None
        self.hash_warned = False  # logged once when no stored root matches kvgate's reproduction of the hash
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._response_loop, name="kvgate-responses", daemon=True)
        self.thread.start()

    # Requests ------------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        """Decoupled: every answer goes through the request's response sender; return None."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except (contract.ContractError, executor_args.SaltUnsupportedError,
                    request_extensions.ExtensionUnsupportedError) as exc:
                # The request's fault: marked as the contract's refusal (engines/contract.py, Errors), so
                # the gateway answers 400 and never retries; an unmarked error is the engine's failure.
                tensor = getattr(exc, "tensor", None)
                reason = f"{tensor}: {exc}" if tensor else str(exc)
                sender.send(_error(refusals.contract_refused(reason)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # an executor failure must answer the client, not hang it
                log.exception("kvgate_llm: request failed")
                sender.send(_error(f"engine error: {exc}"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _read_inputs(self, request: Any) -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = {}
        for spec in contract.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                tensors[spec.name] = tensor.as_numpy()
        return tensors

    def _submit(self, request: Any, sender: Any) -> None:
        tensors = self._read_inputs(request)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if contract.is_stats_request(tensors):
            report = self.stats_report(contract.kv_events_cursor(tensors))
            out = {response_tensors.KV_CACHE_STATS.name: np.array([report.to_json().encode()], dtype=np.object_)}
            sender.send(pb_utils.InferenceResponse(output_tensors=_tensors(out)), flags=final)
            return
        triton_id = request.request_id()
        if contract.STOP.name in tensors and bool(np.asarray(tensors[contract.STOP.name]).reshape(-1)[:1].any()):
            # As the stock tensorrt_llm model and the reference engine: `stop` cancels the
            # running request(s) with the same Triton request id, and gets an empty final answer.
            self._stop(triton_id)
            empty = response_tensors.encode_response([], 0, contract.KvMetrics())
            sender.send(pb_utils.InferenceResponse(output_tensors=_tensors(empty)), flags=final)
            return
        parsed = contract.parse_request(
            tensors,
            max_output_len=self.params.max_output_len,
            max_input_len=self.params.max_input_len,
            vocab_size=self.params.vocab_size,
        )
        trt_request = executor_args.build_request(
            self.trtllm, parsed, default_end_id=self.params.end_id, salt_supported=self.salt_supported,
            bias_layout=self.bias_layout, guided_supported=self.guided_supported,
        )
        end_id = parsed.end_id if parsed.end_id is not None else self.params.end_id
        if parsed.ignore_eos:
            end_id = None  # end_id -1 in the executor: an end token is an ordinary output token
        with self.lock:
            request_id = self.executor.enqueue_request(trt_request)  # executor.cpp: enqueue_request(request) -> id
            self.pending[request_id] = _Pending(sender, parsed, end_id, triton_id)
            if self.event_manager is not None:
                # Roots are matched by TensorRT-LLM's own salted root hash (engines/trtllm/block_key.py):
                # noting after enqueue is safe, the events are drained under this lock.
                self.ledger.note_request(parsed.tenant_id, parsed.input_ids, parsed.cache_salt)
                if self.kv_events is not None:
                    self.kv_events.note_request(parsed.cache_salt, parsed.input_ids)

    # Responses -----------------------------------------------------------------------
    def _response_loop(self) -> None:
        poll = timedelta(milliseconds=self.params.response_poll_ms)
        while not self.stopping.is_set():
            try:
                self.pump(poll)
            except Exception:  # keep serving; one bad response must not kill the loop
                log.exception("kvgate_llm: response loop error")

    def pump(self, timeout: timedelta) -> None:
        """One turn of the response loop: dispatch responses, honour cancellation, drain events."""
        self._cancel_abandoned()  # first: a cancelled client gets nothing more but its final answer
        # executor.cpp: await_responses(timeout: Optional[timedelta]) -> list[Response]
        for response in self.executor.await_responses(timeout=timeout):
            try:  # one failed answer must not cost the rest of the batch theirs (those clients would hang)
                self._dispatch(response)
            except Exception:
                log.exception("kvgate_llm: answering executor request %s failed", getattr(response, "request_id", "?"))
        self.drain_events()

    def _send(self, request_id: int, pending: _Pending, response: Any, *, final: bool) -> bool:
        """Send unless the request's final answer was already sent or claimed; a final answer claims it and
        finishes the request (once). False when nothing was sent."""
        with pending.send_lock:
            if final:
                if not self._finish(request_id, pending):
                    return False
            elif pending.closed:
                return False
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            pending.sender.send(response, flags=flags)
            return True

    def _dispatch(self, response: Any) -> None:
        with self.lock:
            pending = self.pending.get(response.request_id)  # request.cpp: Response.request_id
        if pending is None or pending.closed:
            return
        request_id = response.request_id
        if response.has_error():  # request.cpp: Response.has_error(), .error_msg
            self._send(request_id, pending, _error(f"engine error: {response.error_msg}"), final=True)
            return
        result = response.result  # request.cpp: Result.output_token_ids (per beam), .is_final, .request_perf_metrics
        if pending.cancel_requested and not result.is_final:
            return  # the client went away: only its final answer (the FINAL flag) is still owed
        tokens = [int(t) for t in result.output_token_ids[0]] if result.output_token_ids else []
        raw_count = len(tokens)  # Result.log_probs: one entry per returned token (the C++ returns no end token)
        if pending.end_id is not None:
            while tokens and tokens[-1] == pending.end_id:  # the contract never returns the end token
                tokens.pop()
        pending.generated = pending.generated + len(tokens) if pending.request.streaming else len(tokens)
        log_probs = None
        if pending.request.return_log_probs:
            # request.cpp: Result.log_probs, one list per beam, aligned with output_token_ids; no token (e.g. the
            # final answer of a cancelled request, whose tokens are cleared) has no log probability to check
            values = request_extensions.chosen_log_probs(result, raw_count) if raw_count else []
            if values is not None:
                values = values[: len(tokens)]
            if values is None:
                self._send(request_id, pending, _error(
                    "engine error: return_log_probs was set but the executor returned no log probabilities"), final=True)
                return
            log_probs = [contract.TokenLogProbs(v) for v in values]
        arrays = response_tensors.encode_response(tokens, pending.generated, self._kv_metrics(result), log_probs)
        self._send(request_id, pending, pb_utils.InferenceResponse(output_tensors=_tensors(arrays)), final=bool(result.is_final))

    def _kv_metrics(self, result: Any) -> contract.KvMetrics:
        perf = getattr(result, "request_perf_metrics", None)
        if perf is None:
            return contract.KvMetrics()
        kv = perf.kv_cache_metrics  # request.cpp: KvCacheMetrics(num_total_allocated_blocks, num_new_allocated_blocks, num_reused_blocks, num_missed_blocks, ...)
        reused, missed, total = int(kv.num_reused_blocks), int(kv.num_missed_blocks), int(kv.num_total_allocated_blocks)
        # kvCacheManager.cpp (002ba6a7): num_total_allocated_blocks is the delta of mAllocTotalBlocks around
        # KVCacheManager::addSequence, and only getFreeBlock increments it. In loadOrAllocateBlocks a miss takes
        # one, a match already on the GPU none, a match in host memory one (onboardBlock: getFreeBlock, then
        # mTransferManager->onboard), a partly matched block that is referenced or has children one (copied
        # into a fresh block; at most one per request, matching stops there). So total - missed is the
        # onboards, plus that copy. Without a host tier nothing is ever onboarded (only copies): 0. With one
        # and partial reuse, a request whose match ended in a copied block is over-counted by that one block
        # (the metrics cannot tell the two apart; an exact-key match of a stored partial block can copy too,
        # with partial reuse off, rarely). An onboard is a matched block, so at most ``reused``.
        onboarded = 0
        if self.params.host_cache_size > 0 and self.params.onboard_blocks:
            onboarded = min(reused, max(0, total - missed))
        return contract.KvMetrics(
            reused_blocks=reused,
            # the contract's "new" is a prompt block computed: num_missed_blocks, not num_new_allocated_blocks
            # (slots never used before, ~0 once the pool has turned over: getFreeBlock, kvCacheManager.cpp)
            new_blocks=missed,
            total_blocks=total,
            onboarded_blocks=onboarded,
        )

    def _finish(self, request_id: int, pending: _Pending) -> bool:
        """Claim the request's final answer: True for exactly one caller, which sends it."""
        with self.lock:
            if pending.closed:
                return False
            pending.closed = True
            self.pending.pop(request_id, None)
            self.finished.append(pending.request)
            return True

    def _stop(self, triton_id: str) -> None:
        if not triton_id:
            return
        with self.lock:
            stopped = [(rid, p) for rid, p in self.pending.items() if p.triton_id == triton_id and not p.closed]
        for request_id, pending in stopped:
            self.executor.cancel_request(request_id)  # executor.cpp: cancel_request(id)
            empty = response_tensors.encode_response([], pending.generated, contract.KvMetrics())
            # its final answer now; the executor's final CANCELLED response then finds the entry gone
            self._send(request_id, pending, pb_utils.InferenceResponse(output_tensors=_tensors(empty)), final=True)

    def _cancel_abandoned(self) -> None:
        # As the stock tensorrt_llm model (triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py
        # cancellation_loop): cancel_request and keep the entry; the executor then answers with the request's
        # final response (executorImpl.cpp terminateCancelledRequests: finish reason CANCELLED), which _dispatch
        # forwards with the FINAL flag Triton still needs for a cancelled request (python_backend README).
        with self.lock:
            cancelled = []
            for request_id, pending in self.pending.items():
                if not pending.closed and not pending.cancel_requested and pending.sender.is_cancelled():
                    pending.cancel_requested = True
                    cancelled.append(request_id)
        for request_id in cancelled:
            self.executor.cancel_request(request_id)  # executor.cpp: cancel_request(id)

    # Stats ---------------------------------------------------------------------------
    def drain_events(self) -> None:
        # Runs on the response thread (pump) and on Triton's execute thread (stats_report). getEvents hands each
        # caller its own batch (kvCacheEventManager.cpp: std::exchange(mEvents, {})), so a batch is fetched and
        # applied in one critical section: two batches are applied in the order they were taken. With timeout 0
        # the fetch does not wait (mEmptyCV.wait_for(0)).
        with self.lock:
            # bindings.cpp kv_cache.KVCacheEventManager.get_latest_events(timeout_ms: Optional[float])
            events = self.event_manager.get_latest_events(timeout_ms=0.0) if self.event_manager is not None else []
            if events:
                self.ledger.apply(events)
                if self.kv_events is not None:
                    self.kv_events.apply(events)
                    if not self.hash_warned and self.kv_events.hash_mismatch_suspected():
                        self.hash_warned = True
                        log.error(
                            "kvgate_llm: %d stored root blocks matched no request: this TensorRT-LLM build's block hash "
                            "differs from engines/trtllm/block_key.py, so KV events cannot be attributed to salts or "
                            "tenants (routers get no credit, quotas see unattributed blocks)",
                            self.kv_events.unmatched_roots,
                        )
            # A finished request stops being pending in the ledger (shared-prefix FIFO); its root hash
            # still resolves there and in the translator, so events later than this drain (the event
            # manager's worker thread hands them over asynchronously) are still attributed exactly.
            for done in self.finished:
                self.ledger.forget_request(done.tenant_id, done.input_ids, done.cache_salt)
            self.finished.clear()

    def stats_report(self, events_since: int | None = None) -> pool_stats.PoolStatsReport:
        self.drain_events()
        # executor.cpp: deque of the IterationStats since the last call — empty when no iteration ran;
        # IterationStats.kv_cache_stats is std::optional<KvCacheStats> (executor/types.h): keep the
        # newest one present, fall back to the event ledger when there never was one.
        stats = self.executor.get_latest_iteration_stats()
        for iteration in reversed(stats or ()):
            if iteration.kv_cache_stats is not None:
                self.latest_kv_stats = iteration.kv_cache_stats
                break
        kv = self.latest_kv_stats
        with self.lock:
            tiers = self.ledger.tier_blocks()
            secondary_max = self.ledger.level_capacity[1]
            if kv is not None:
                # KvCacheStats (kvCacheManager.h): used = max - free, and a block kept for reuse is free
                # (evictionPolicy.cpp releaseBlock): used is what running requests hold.
                primary = pool_stats.TierStats(int(kv.max_num_blocks), int(kv.free_num_blocks), int(kv.used_num_blocks))
            else:
                # No KvCacheStats yet: the same meaning, estimated from the running requests (blocks of their
                # tokens; a prefix shared by two running requests is counted twice, so an upper bound).
                capacity = self.ledger.level_capacity[0]
                tpb = self.params.tokens_per_block
                held = sum(-(-(len(p.request.input_ids) + p.generated) // tpb) for p in self.pending.values())
                used = min(held, capacity)
                primary = pool_stats.TierStats(max_blocks=capacity, free_blocks=capacity - used, used_blocks=used)
            report = pool_stats.PoolStatsReport(
                tokens_per_block=int(kv.tokens_per_block) if kv is not None else self.params.tokens_per_block,
                primary=primary,
                secondary=pool_stats.TierStats(max_blocks=secondary_max, free_blocks=max(secondary_max - tiers[1], 0), used_blocks=tiers[1]),
                reused_blocks=int(kv.reused_blocks) if kv is not None else 0,
                missed_blocks=int(kv.missed_blocks) if kv is not None else 0,
                alloc_total_blocks=int(kv.alloc_total_blocks) if kv is not None else 0,
                alloc_new_blocks=int(kv.alloc_new_blocks) if kv is not None else 0,
                offloaded_blocks=self.ledger.offloaded,
                onboarded_blocks=self.ledger.onboarded,
                evicted_blocks=self.ledger.evicted,
                cache_hit_rate=float(kv.cache_hit_rate) if kv is not None else 0.0,
                secondary_offload_min_priority=self.params.secondary_offload_min_priority,
                tenants=self.ledger.tenants(),
            )
            if events_since is not None:
                report.kv_events = (self.kv_events.log.report(events_since) if self.kv_events is not None
                                    else KvEventsReport.unsupported())
        return report

    def finalize(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.executor.shutdown()  # executor.cpp: shutdown()
