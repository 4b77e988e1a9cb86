"""The ``fake_trtllm`` Executor: cpp/tensorrt_llm/nanobind/executor/executor.cpp (enqueue_request,
await_responses, cancel_request, get_latest_iteration_stats, get_kv_cache_event_manager, shutdown) over a
tiny simulated engine.

At construction it reads the engine's ``config.json`` (``fake_trtllm_engine``) and fixes the configuration
as TensorRT-LLM does (batch_manager/trtGptModelInflightBatching.cpp, executor/executorImpl.cpp). A request
is validated and planned at enqueue (``fake_trtllm_plan``), then played out by iterations (``step``): the
KV block manager (``fake_block_manager``) matches, stores and releases its blocks and records the events,
which each iteration flushes. Invariants: ``requests`` keeps every enqueued request by id (ids count from
1); ``active`` holds the planned requests not yet released; ``ready`` the Responses not yet handed out;
every public method holds ``lock`` while it touches them, except the test helpers at the end.
"""

from __future__ import annotations

import threading
import types
from collections import deque
from typing import Any

from tests.engines.triton.fake_block_manager import FakeBlockManager
from tests.engines.triton.fake_trtllm_bound import Bound
from tests.engines.triton.fake_trtllm_checks import check_duration, check_int
from tests.engines.triton.fake_trtllm_engine import read_limits, read_logits, read_plugin
from tests.engines.triton.fake_trtllm_plan import ActiveRequest, plan_request, request_error
from tests.engines.triton.fake_trtllm_stats import KvCacheCounters


class Executor(Bound):
    def __init__(self, model_path, model_type, executor_config):
        bindings = self._bindings
        if not isinstance(model_type, bindings.ModelType):
            raise TypeError("model_type: expected ModelType")
        if not isinstance(executor_config, bindings.ExecutorConfig):
            raise TypeError("executor_config: expected ExecutorConfig")
        self.model_path, self.model_type, self.config = model_path, model_type, executor_config
        self.paged_context_fmha, self.tokens_per_block = read_plugin(model_path)
        self.logits_dtype, self.vocab_size, self.vocab_size_padded = read_logits(model_path)
        kv_config = getattr(executor_config, "kv_cache_config", None)
        if kv_config is None:  # executor.h KvCacheConfig defaults
            kv_config = types.SimpleNamespace(onboard_blocks=True, enable_block_reuse=True, event_buffer_max_size=0,
                                              enable_partial_reuse=True, copy_on_partial_reuse=True)
        orchestrator = getattr(executor_config, "parallel_config", None) is not None and \
            executor_config.parallel_config.communication_mode is bindings.CommunicationMode.ORCHESTRATOR
        self.warnings: list[str] = []
        # trtGptModelInflightBatching.cpp (NVIDIA/TensorRT-LLM 00825c4e) constructor: with onboarding
        # off, TLLM_CHECK_WITH_INFO(!getPagedContextFMHA(), "KV cache blocks need to be onboarded if
        # context FMHA.") -> TllmException -> RuntimeError; every rank (the orchestrator's workers
        # included) builds this model, so the executor fails to start either way.
        if not kv_config.onboard_blocks and self.paged_context_fmha:
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: KV cache blocks need to be onboarded if context FMHA.")
        # executor/executorImpl.cpp (b35ac1b6) fixExecutorConfig, applied in createModel before the model's
        # own fixExecutorConfig below: chunked context on an engine without paged context FMHA (or without a
        # KV cache, or an RNN) -> TLLM_LOG_WARNING and enableChunkedContext = false.
        # nanobind/executor/executorConfig.cpp: nb::arg("enable_chunked_context") = false.
        self.chunked_context = getattr(executor_config, "enable_chunked_context", False)
        if self.chunked_context and not self.paged_context_fmha:
            self.warnings.append("Chunked context is not supported for this configuration and will be disabled. "
                                 "Related configs: RNNBased: 0, KVCacheEnabled: 1, PagedContextFMHA: 0")
            self.chunked_context = False
        # trtGptModelInflightBatching.cpp fixExecutorConfig: reuse requested on an engine without
        # paged context FMHA -> TLLM_LOG_WARNING and enableBlockReuse = false; the executor runs.
        self.block_reuse = bool(kv_config.enable_block_reuse)
        if self.block_reuse and not self.paged_context_fmha:
            self.warnings.append("Fixing executorConfig: KV cache reuse disabled because model was not built with "
                                 "paged context FMHA support")
            self.block_reuse = False
        # batch_manager/trtGptModel.h TrtGptModel ctor: mMaxNumTokens is the engine's max_num_tokens, lowered
        # (never raised: "is larger than model max num tokens ... will be ignored") by ExecutorConfig.max_num_tokens;
        # mMaxInputLen = maxSequenceLen - 1 with chunked context, min(maxSequenceLen - 1, maxNumTokens) with context
        # FMHA and packed input ("Max number of tokens has to be set" otherwise), else the engine's max_input_len.
        context_fmha, packed, engine_input_len, self.max_seq_len, max_num_tokens = read_limits(model_path)
        runtime_tokens = getattr(executor_config, "max_num_tokens", None)
        if runtime_tokens is not None and max_num_tokens is not None and runtime_tokens <= max_num_tokens:
            max_num_tokens = runtime_tokens
        if self.chunked_context:
            self.max_input_len = self.max_seq_len - 1
        elif context_fmha and packed:
            if max_num_tokens is None:
                raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: Max number of tokens has to be set for "
                                   "context FMHA and usePackedInput case.")
            self.max_input_len = min(self.max_seq_len - 1, max_num_tokens)
        else:
            self.max_input_len = engine_input_len
        self.has_local_model = not orchestrator  # executorImpl.cpp: the orchestrator holds no mModel
        # executor.h SchedulerConfig (879039f6): capacitySchedulerPolicy defaults to kGUARANTEED_NO_EVICT (kvgate
        # sends no scheduler_config). capacityScheduler.cpp (cf6abc45): GuaranteedNoEvictScheduler::operator()
        # (impl<false>) and MaxUtilizationScheduler::operator() consult beneficialToSkip; StaticBatchScheduler
        # (impl<true>) never does. The double has no SchedulerConfig class: a policy is read by its name.
        policy = getattr(getattr(executor_config, "scheduler_config", None), "capacity_scheduler_policy", None)
        self.skip_for_reuse = getattr(policy, "name", "GUARANTEED_NO_EVICT") != "STATIC_BATCH"
        self.iter_stats_max_iterations = getattr(executor_config, "iter_stats_max_iterations", 1000)
        # executorConfig.cpp (nanobind) ExecutorConfig init: nb::arg("normalize_log_probs") = true
        self.normalize_log_probs = getattr(executor_config, "normalize_log_probs", True)
        self.lock = threading.Lock()
        self.ready: deque = deque()
        self.requests: dict[int, Any] = {}
        self.cancelled: list[int] = []
        self.active: dict[int, ActiveRequest] = {}  # enqueued, not finished (scheduled at the next iteration)
        self.auto_run = True  # await_responses runs iterations until every request finished
        self.next_id = 1
        self.kv_counters = KvCacheCounters(bindings.primary_blocks, block_reuse=self.block_reuse)
        self.iteration_stats: deque = deque(maxlen=max(self.iter_stats_max_iterations, 1))
        self.events = bindings.KVCacheEventManager(kv_config.event_buffer_max_size)
        self.blocks = FakeBlockManager(self.tokens_per_block, enable_block_reuse=self.block_reuse,
                                       enqueue_stored=self._stored, enqueue_removed=self._removed,
                                       enable_partial_reuse=kv_config.enable_partial_reuse,
                                       copy_on_partial_reuse=kv_config.copy_on_partial_reuse,
                                       enqueue_onboarded=self._onboarded)
        # kvCacheManager.cpp WindowBlockManager ctor: enqueueCreatedEvent. Flushed at once here (the real
        # one waits for the first iteration's flush) so a stats call before any request sees the sizes.
        self._event(bindings.KVCacheCreatedData([bindings.primary_blocks, bindings.secondary_blocks]))
        self.events.queue.flush()
        self.shut = False
        bindings.executors.append(self)

    @property
    def tree(self):
        """The reuse tree: TensorRT-LLM block hash -> block (fake_block_manager.TreeBlock)."""
        return self.blocks.tree

    def _event(self, data):
        if self.events.buffer_max_size == 0:
            return  # no event manager in the block manager: nothing is recorded
        self.events.queue.enqueue(data)

    def _stored(self, parent_hash, blocks):
        # kvCacheEventManager.cpp enqueueStoredEvent: KVCacheStoredBlockData(getHash(), getUniqueTokens(),
        # loraTaskId, isPrimary() ? kPrimaryLevel : kSecondaryLevel, getPriority())
        bindings = self._bindings
        self._event(bindings.KVCacheStoredData(parent_hash, [
            bindings.KVCacheStoredBlockData(b.block_hash, [bindings.UniqueToken(t) for t in b.tokens], b.level, 35)
            for b in blocks]))

    def _onboarded(self, block_hash):
        # kvCacheManager.cpp WindowBlockManager::onboardBlock: enqueueUpdatedEvent(KVCacheUpdatedData(hash)
        # .cacheLevelUpdated(kSecondaryLevel, kPrimaryLevel)), flushed with the iteration's events
        self._event(self._bindings.KVCacheUpdatedData(block_hash, self._bindings.KVCacheEventDiffInt(1, 0), None))

    def _removed(self, block_hash):
        if self.events.buffer_max_size:
            self.events.queue.enqueue_removed(block_hash, self._bindings.KVCacheRemovedData)

    def enqueue_request(self, request):
        if not isinstance(request, self._bindings.Request):
            raise TypeError("request: expected Request")
        with self.lock:
            request_id = self.next_id
            self.next_id += 1
            self.requests[request_id] = request
            self._run(request_id, request)
        return request_id

    def _run(self, request_id, request):
        """Fail the request (an error Response) or plan its tokens and responses (``fake_trtllm_plan``)."""
        error = request_error(self, request)
        if error is not None:
            self.ready.append(self._bindings.Response(request_id, None, error))
            return
        self.active[request_id] = plan_request(self._bindings, request_id, request,
                                               normalize_log_probs=self.normalize_log_probs)

    def step(self):
        """One iteration (trtGptModelInflightBatching.cpp forwardAsync + forwardSync) over every active request.

        Scheduling (``_starting``) has no capacity model: every running request continues and every new one
        starts, except one the capacity scheduler delays so that it can reuse the blocks another starting
        request is about to store. Order, as in the C++: the scheduler decides on the tree as it is before
        the iteration; starting requests get their sequence (KVCacheManager::addSequence: reuse matching,
        per-request KV metrics) and requests in generation one KV slot each (KVCacheManager::addToken, both in
        allocateKvCache.cpp AllocateKvCache::operator()); forwardAsync stores context blocks of requests whose
        context ran and the newest block of requests in generation; forwardSync appends each request's next
        token (no slot: the next step's addToken gives it one, if there is a next step) and releases
        finished (or cancelled) requests, storing their blocks (a sampled end id is not appended: it ends the
        request, ``fake_trtllm_plan``); responses go out; flushIterationEvents hands the events over. A delayed
        request does none of this and is scheduled again at the next iteration.
        """
        with self.lock:
            self._step()

    def _starting(self) -> list[int]:
        """The new requests that start this iteration, in the order they were enqueued (``activeRequests``).

        capacityScheduler.cpp (NVIDIA/TensorRT-LLM cf6abc45) ``GuaranteedNoEvictScheduler::impl`` /
        ``MaxUtilizationScheduler::operator()``: each pending request is first passed to ``beneficialToSkip``,
        which, for a request in context-init state on its first context chunk and only when
        ``kvCacheManager.isEnableBlockReuse()``, calls ``oneManagerBeneficialToSkip``: the request's
        ``findNewContextBlock`` key (``fake_block_manager.find_new_context_block``) already in
        ``newlyContributedContextBlocks`` -> skipped this iteration; otherwise the key is added (whether or not
        the request then fits). ``skippingIsRelevant`` is false only for variable-window attention (the double
        has one window). The set starts with the keys of requests already mid-chunk
        (``prefillWithChunkedContextsAlreadyExecuting``): empty here, the double runs a context in one chunk.
        """
        contributed: set = set()  # newlyContributedContextBlocks
        starting = []
        for request_id, active in self.active.items():
            if request_id in self.cancelled or active.scheduled:
                continue
            if self.block_reuse and self.skip_for_reuse:
                request = active.request
                key = self.blocks.find_new_context_block(request.input_token_ids, request.cache_salt_id)
                if key is not None:
                    if key in contributed:
                        continue  # "Better to skip this step so we can reuse."
                    contributed.add(key)
            starting.append(request_id)
        return starting

    def _step(self):
        bindings, blocks = self._bindings, self.blocks
        starting = self._starting()
        for request_id in starting:
            request = self.active[request_id].request
            admission = blocks.add_sequence(request_id, request.input_token_ids, request.cache_salt_id)
            self.kv_counters.admit(self.active[request_id].kv, admission)
        for request_id, active in self.active.items():
            # allocateKvCache.cpp (d2b9c97c) AllocateKvCache::operator(), in forwardAsync before the engine step
            # (trtGptModelInflightBatching.cpp b35ac1b6): addToken for each generation request only, for the token
            # this step feeds (the one the last step generated); a request's final token is never fed.
            if active.scheduled and request_id not in self.cancelled and blocks.add_token(request_id):
                self.kv_counters.generation_block()
        for request_id, active in self.active.items():  # forwardAsync
            if request_id in self.cancelled or not (active.scheduled or request_id in starting):
                continue
            if not active.scheduled:
                blocks.store_context_blocks(request_id)  # context ran in this iteration
            else:
                blocks.store_new_block(request_id)
            active.scheduled = True
        finished = []
        for request_id, active in self.active.items():  # forwardSync
            if request_id in self.cancelled:
                # executorImpl.cpp terminateCancelledRequests (after forwardSync): kGENERATION_COMPLETE,
                # terminateRequest (its blocks are released, and stored), finishByReason(kCANCELLED),
                # clearGeneratedTokens; populateNewResponses then sends its final Response (llmRequest.cpp
                # createResult: isFinal, no output tokens once they are cleared, finish reason CANCELLED).
                asked = active.request.output_config.return_log_probs
                self.ready.append(bindings.Response(request_id, bindings.Result(
                    [], True, bindings.RequestPerfMetrics(active.kv), [] if asked else None,
                    bindings.FinishReason.CANCELLED)))
                finished.append(request_id)
                continue
            if not active.scheduled:
                continue  # delayed by the capacity scheduler: no context ran, nothing to append
            if active.sampled < active.steps:
                # updateRequests: addNewToken only for the tokens the decoder's sequence length advanced by; a
                # sampled end id does not advance it (samplingTopKKernels.cu), so it never joins the request
                if active.sampled < len(active.generated):
                    blocks.append_token(request_id, active.generated[active.sampled])
                active.sampled += 1
            if active.request.streaming:
                self.ready.append(active.planned[active.sampled - 1])
            if active.sampled == active.steps:
                if not active.request.streaming:
                    self.ready.append(active.planned[0])
                finished.append(request_id)
        for request_id in finished:
            blocks.release(request_id)
            del self.active[request_id]
        self.iteration_stats.append(bindings.IterationStats(self._kv_stats() if bindings.kv_cache_stats else None))
        self.events.queue.flush()

    def _kv_stats(self):
        return self.kv_counters.stats(self._bindings.KvCacheStats, self.blocks.blocks_in_use(), self.tokens_per_block)

    def await_responses(self, timeout=None):
        check_duration("timeout", timeout)
        while self.auto_run and self.active:  # the executor's own loop; tests set auto_run False to step
            self.step()
        # executorImpl.cpp awaitResponses hands over every queued Response: a request cancelled after some of
        # its responses were produced still delivers them, then its final CANCELLED one.
        with self.lock:
            out = list(self.ready)
            self.ready.clear()
        return out

    def cancel_request(self, id=None):
        check_int("id", id, lo=0)
        self.cancelled.append(id)

    def get_latest_iteration_stats(self):
        # executor.h: "the per-iteration statistics computed since last call" — a std::deque that is
        # empty when no iteration ran since; each IterationStats.kv_cache_stats is optional.
        with self.lock:
            out = deque(self.iteration_stats)
            self.iteration_stats.clear()
        return out

    def can_enqueue_requests(self):
        return True

    def get_kv_cache_event_manager(self):
        # executorImpl.cpp getKVCacheEventManager (NVIDIA/TensorRT-LLM b35ac1b6): std::nullopt only
        # without a local model (the orchestrator process); otherwise a manager around the KV cache
        # manager, whatever event_buffer_max_size is (0: its events just never arrive).
        if not self.has_local_model:
            return None
        return self.events

    def shutdown(self):
        self.shut = True

    # test helpers: what the real pool would report on an offload / onboard / eviction, as if an iteration
    # ran (kvCacheManager.cpp getFreeBlock / offloadBlock / onboardBlock: KVCacheUpdatedData(...)
    # .cacheLevelUpdated; freeChildren: one removal per block, descendants first)
    def offload(self, block_hash):
        self.tree[block_hash].level = 1
        self._event(self._bindings.KVCacheUpdatedData(block_hash, self._bindings.KVCacheEventDiffInt(0, 1), None))
        self.events.queue.flush()

    def onboard(self, block_hash):
        self.tree[block_hash].level = 0
        self._event(self._bindings.KVCacheUpdatedData(block_hash, self._bindings.KVCacheEventDiffInt(1, 0), None))
        self.events.queue.flush()

    def evict(self, block_hash):
        self.blocks.evict(block_hash)
        self.events.queue.flush()
