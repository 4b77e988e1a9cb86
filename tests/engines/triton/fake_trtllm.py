"""A recording double of ``tensorrt_llm.bindings.executor`` (TensorRT-LLM release/1.2).

Only for tests: TensorRT-LLM cannot run here. Every constructor mirrors the binding's
argument names, keyword-only markers, defaults and types as read in the sources, and
refuses anything else with ``TypeError`` (nanobind raises TypeError for bad arguments).
The sources are 1.2-era main-branch snapshots of NVIDIA/TensorRT-LLM (the v1.2.1 tag
itself could not be read here; docs/architecture.md "Production path" lists which
snapshot each signature comes from and what that leaves unconfirmed):

* KvCacheConfig, ExecutorConfig — cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp
* Request, SamplingConfig, OutputConfig, KvCacheRetentionConfig(.TokenRangeRetentionConfig),
  Response/Result/KvCacheMetrics — cpp/tensorrt_llm/nanobind/executor/request.cpp
* Executor (enqueue_request, await_responses, cancel_request, get_latest_iteration_stats,
  get_kv_cache_event_manager, shutdown) — cpp/tensorrt_llm/nanobind/executor/executor.cpp
* KvCacheStats, IterationStats, ModelType, ``__version__``, kv_cache.* events — .../nanobind/executor/bindings.cpp
* ``get_kv_cache_event_manager()`` is None in an orchestrator process (no local model:
  cpp/tensorrt_llm/executor/executorImpl.cpp ``getKVCacheEventManager``)

What the real executor does silently or refuses, modelled here (each rule cites its source
next to the code that applies it): it reads the engine's ``config.json``
(runtime/gptJsonConfig.cpp), aborts for ``onboard_blocks=False`` with paged context FMHA
and runs with reuse off when the engine lacks it (batch_manager/
trtGptModelInflightBatching.cpp), regularizes top-k/top-p so an unset pair means greedy
(kernels/samplingTopKKernels.h ``regularizeTopKTopP``), validates retention ranges
(executor/kvCacheRetentionConfig.cpp), stores blocks for reuse and reports them when the
KV cache manager does (``fake_block_manager.py``: storeContextBlocks / storeNewBlock /
releaseBlocks, one stored event per store call, events flushed per iteration and handed over
late by the event manager's worker), returns only the iteration stats since the last call,
and exposes an event manager even with a zero event buffer. It answers a cancelled request with
a final ``CANCELLED`` Result (executor/executorImpl.cpp ``terminateCancelledRequests``), refuses
a prompt longer than the model's maximum input length with TensorRT-LLM's own wording
(batch_manager/trtGptModel.h ``mMaxInputLen``, llmRequest.cpp ``validate``), and reports
``KvCacheStats`` as the KV cache manager counts them (evictionPolicy.cpp, kvCacheManager.cpp).
Sampling/request rules: ``normalize_log_probs`` defaults to true and then a greedy token's log
probability is 0.0 (executorConfig.cpp, samplingTopKKernels.cu ``topKStage2Sampling``); an
``embedding_bias`` of the wrong dtype or shape fails the request as
batch_manager/createNewDecoderRequests.cpp does (an error Response); ``min_tokens`` with end id
-1 fails loudly where the real penalty kernel would write out of bounds. ``batch_apply_penalty``
and ``sampled_log_prob`` re-implement the kernels' logit processing and log probabilities
(penaltyKernels.cu, samplingTopKKernels.cu) for tests that compare the reference sampler.
Exceptions are what nanobind makes of the C++ ones (nanobind src/nb_internals.cpp
``default_exception_translator``): ``std::invalid_argument`` → ValueError, any other
``std::exception`` (``TLLM_CHECK`` throws ``TllmException``, a ``std::runtime_error``) → RuntimeError.

Durations are ``datetime.timedelta`` (``std::chrono::milliseconds`` via nanobind stl/chrono.h).
The simulated engine is tiny: it "generates" deterministic tokens and runs iterations
(``Executor.step``; ``await_responses`` runs them until every request finished unless a test
sets ``auto_run = False`` and steps by hand), with a KV block manager that matches, stores and
releases blocks under TensorRT-LLM's own salted block hash (``fake_block_manager.py``).

Layout (each module states its invariants; every rule cites its TensorRT-LLM source next to the code):
``fake_trtllm_config`` (executorConfig.cpp classes, ModelType), ``fake_trtllm_request`` (Request and
its parts), ``fake_trtllm_response`` (Response, Result, FinishReason, metrics), ``fake_trtllm_executor``
(Executor: configuration fixes, iterations), ``fake_trtllm_plan`` (validation and the planned tokens of
a request), ``fake_trtllm_kv_events`` (kv_cache.* events, KVCacheEventManager), ``fake_trtllm_stats``
(IterationStats, KvCacheStats and their counters), ``fake_trtllm_engine`` (config.json),
``fake_trtllm_sampling`` (kernel arithmetic), ``fake_trtllm_checks`` (nanobind's argument checks),
``fake_trtllm_bound`` (what one module's classes share). This module builds a module from them
(``make_module``) and installs it (``install``).
"""

from __future__ import annotations

import sys
import types

from tests.engines.triton import fake_trtllm_config as config
from tests.engines.triton import fake_trtllm_kv_events as kv_events
from tests.engines.triton import fake_trtllm_request as request
from tests.engines.triton import fake_trtllm_response as response
from tests.engines.triton import fake_trtllm_stats as stats
from tests.engines.triton.fake_trtllm_bound import Bindings, bind, fresh_enum
from tests.engines.triton.fake_trtllm_checks import NONE
from tests.engines.triton.fake_trtllm_engine import write_engine_config
from tests.engines.triton.fake_trtllm_executor import Executor
from tests.engines.triton.fake_trtllm_plan import FETCH_ERROR, LLM_REQUEST_THROW_AT, PROMPT_TOO_LONG
from tests.engines.triton.fake_trtllm_sampling import (
    DEFAULT_TOP_K, DEFAULT_TOP_P, FLT_MAX, batch_apply_penalty, regularize_top_k_top_p, sampled_log_prob)

__all__ = [
    "DEFAULT_TOP_K", "DEFAULT_TOP_P", "FETCH_ERROR", "FLT_MAX", "LLM_REQUEST_THROW_AT", "NONE", "PROMPT_TOO_LONG",
    "Executor", "batch_apply_penalty", "install", "make_module", "regularize_top_k_top_p", "sampled_log_prob",
    "write_engine_config",
]


def make_module(*, salt_supported: bool = True, primary_blocks: int = 64, secondary_blocks: int = 256,
                version: str | None = "1.2.1", kv_cache_stats: bool = True, event_lag: int = 0) -> types.ModuleType:
    """A fresh fake module; ``module.calls`` records (class name, kwargs) of every construction.

    ``kv_cache_stats=False``: ``IterationStats.kv_cache_stats`` is None (``std::optional<KvCacheStats>``
    in executor/types.h; empty e.g. on a rank without a KV cache manager). ``event_lag``: how many
    ``get_latest_events`` calls miss an iteration's events before they arrive (the event manager's
    worker thread, ``fake_block_manager.FakeEventQueue``).

    Every class and enum of the module is new (``fake_trtllm_bound``): objects of one module are refused
    by another's constructors and executors.
    """
    mod = types.ModuleType("tensorrt_llm.bindings.executor")
    if version is not None:
        mod.__version__ = version  # bindings.cpp: m.attr("__version__") = tle::version()
    calls: list[tuple[str, dict]] = []
    mod.calls = calls
    mod.executors = []
    b = Bindings(calls=calls, executors=mod.executors, salt_supported=salt_supported, primary_blocks=primary_blocks,
                 secondary_blocks=secondary_blocks, kv_cache_stats=kv_cache_stats, event_lag=event_lag)
    for template in (config.ModelType, config.CommunicationMode, config.GuidedDecodingBackend, request.GuideType,
                     response.FinishReason):
        setattr(b, template.__name__, fresh_enum(template))
    for template in (config.KvCacheConfig, config.ExecutorConfig, config.OrchestratorConfig, config.ParallelConfig,
                     request.SamplingConfig, request.OutputConfig, response.KvCacheMetrics,
                     response.RequestPerfMetrics, response.Result, response.Response, *kv_events.KV_CACHE_CLASSES,
                     kv_events.KVCacheEventManager, stats.KvCacheStats, stats.IterationStats, Executor):
        setattr(b, template.__name__, bind(template, b))
    # Nested names: KvCacheRetentionConfig.TokenRangeRetentionConfig, GuidedDecodingParams.GuideType,
    # GuidedDecodingConfig.GuidedDecodingBackend (request.cpp, executorConfig.cpp).
    b.TokenRangeRetentionConfig = bind(request.TokenRangeRetentionConfig, b)
    b.KvCacheRetentionConfig = bind(request.KvCacheRetentionConfig, b,
                                    TokenRangeRetentionConfig=b.TokenRangeRetentionConfig)
    b.GuidedDecodingParams = bind(request.GuidedDecodingParams, b, GuideType=b.GuideType)
    b.GuidedDecodingConfig = bind(config.GuidedDecodingConfig, b, GuidedDecodingBackend=b.GuidedDecodingBackend)
    b.Request = bind(request.Request if salt_supported else request.RequestWithoutSalt, b, name="Request")

    kv_cache = types.ModuleType("tensorrt_llm.bindings.executor.kv_cache")
    for template in kv_events.KV_CACHE_CLASSES:
        setattr(kv_cache, template.__name__, getattr(b, template.__name__))
    for obj in (b.CommunicationMode, b.OrchestratorConfig, b.ParallelConfig, b.ModelType, b.KvCacheConfig,
                b.ExecutorConfig, b.KvCacheRetentionConfig, b.SamplingConfig, b.OutputConfig, b.Request, b.Response,
                b.Result, b.FinishReason, b.KvCacheStats, b.IterationStats, b.Executor, b.GuidedDecodingParams,
                b.GuidedDecodingConfig):
        setattr(mod, obj.__name__, obj)
    mod.kv_cache = kv_cache
    return mod


def install(module: types.ModuleType, monkeypatch) -> None:
    """Make ``import tensorrt_llm.bindings.executor`` return ``module`` for one test."""
    root = types.ModuleType("tensorrt_llm")
    bindings = types.ModuleType("tensorrt_llm.bindings")
    root.bindings = bindings
    bindings.executor = module
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", module)
