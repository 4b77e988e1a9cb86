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
"""

from __future__ import annotations

import enum
import json
import sys
import threading
import types
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.engines.triton.fake_block_manager import FakeBlockManager, FakeEventQueue

NONE = object()

# executor/executorImpl.cpp fetchNewRequests: a request that fails validation gets an error Response
# "Encountered an error when fetching new request: " + e.what(); batch_manager/llmRequest.cpp
# LlmRequest::validate (NVIDIA/TensorRT-LLM 119c6e60) throws, for a prompt over the model's maximum
# input length, TLLM_THROW("Prompt length (%d) exceeds maximum input length (%d). Set log level to info
# and check TRTGptModel logs for how maximum input length is set"). TllmException::what()
# (common/tllmException.cpp) appends " (<file>:<line>)" and a backtrace after a newline; the double
# writes the file relative to the source tree, line 0, and no backtrace.
FETCH_ERROR = "Encountered an error when fetching new request: "
PROMPT_TOO_LONG = ("Prompt length ({}) exceeds maximum input length ({}). Set log level to info and check "
                   "TRTGptModel logs for how maximum input length is set")
LLM_REQUEST_THROW_AT = " (cpp/tensorrt_llm/batch_manager/llmRequest.cpp:0)"


@dataclass(slots=True)
class _Active:
    """A request between enqueue and release: its planned tokens and responses (see Executor.step)."""

    request: Any
    generated: list[int]
    planned: list[Any]
    kv: Any  # the KvCacheMetrics its responses carry, filled when it is scheduled
    scheduled: bool = False
    produced: int = 0

# cpp/tensorrt_llm/layers/defaultDecodingParams.h: getTopK() = 0, getTopP() = 0.0f — what an
# unset SamplingConfig.top_k / top_p becomes in the decoding layers.
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 0.0


def regularize_top_k_top_p(top_k: int, top_p: float) -> tuple[int, float]:
    """cpp/tensorrt_llm/kernels/samplingTopKKernels.h ``regularizeTopKTopP``, applied by every sampling layer.

    (0, 0.0) → top_k 1 (greedy: "topp = 0.0f ... equivalent to greedy search");
    (k > 0, 0.0) → top_p 1.0 (top-k only).
    """
    if top_k == 0 and top_p == 0.0:
        top_k = 1
    if top_k > 0 and top_p == 0.0:
        top_p = 1.0
    return top_k, top_p


FLT_MAX = 3.4028234663852886e38  # penaltyKernels.cu MASK_VAL for float logits (-FLT_MAX)


def batch_apply_penalty(logits: Any, *, prompt: list[int], output: list[int], bias: Any = None,
                        temperature: float | None = None, repetition_penalty: float | None = None,
                        presence_penalty: float | None = None, frequency_penalty: float | None = None,
                        min_length: int = 0, end_id: int | None = None) -> Any:
    """One row (beam 1) of cpp/tensorrt_llm/kernels/penaltyKernels.cu ``batchApplyPenalty``, in numpy.

    Read at NVIDIA/TensorRT-LLM 249d93d5 (a 2024-25 main snapshot; the 1.2.1 tag could not be
    read, the kernel has not changed shape across the snapshots in the index). Per token of
    the vocabulary: ``logit + bias``, then ``× 1/(temperature + 1e-6)`` when the temperature is
    not 1 (``DefaultDecodingParams::getTemperature``), then — only for tokens whose occurrence
    count is > 0, counted over the prompt in the context phase and every generated token since
    — repetition (``logit < 0 ? logit × p : logit / p``), presence (``- p``), frequency
    (``- p × count``), then every logit is clamped to ±FLT_MAX ("do clamp to prevent overflow",
    seen at 3c44cb97: ``logit > -MASK_VAL`` → ``-MASK_VAL``, ``logit < MASK_VAL`` → ``MASK_VAL``; a
    NaN passes both comparisons unchanged). Then, while ``currentStep - inputLen < minLength``, the
    end id's logit becomes ``-FLT_MAX``: ``outLogitsPtr[endIds[batchSlot]]``, unguarded — with end
    id -1 (how ``ignore_eos`` is sent) that is a write before the row, which this re-implementation
    refuses.
    """
    import numpy as np

    out = np.asarray(logits, dtype=np.float32).astype(np.float64)
    vocab = out.shape[-1]
    if bias is not None:
        out = out + np.asarray(bias, dtype=np.float64)
    if temperature is not None and abs(temperature - 1.0) >= 1e-9:
        out = out * (1.0 / (temperature + 1e-6))
    defaults = (repetition_penalty in (None, 1.0), presence_penalty in (None, 0.0), frequency_penalty in (None, 0.0))
    if not all(defaults):  # accumulateVocab
        counts = np.zeros(vocab, dtype=np.int64)
        for token in list(prompt) + list(output):
            if token < vocab:  # "if (penaltyIndex < vocabSize)"
                counts[token] += 1
        seen = counts > 0
        if repetition_penalty is not None:
            out = np.where(seen & (out < 0), out * repetition_penalty, np.where(seen, out / repetition_penalty, out))
        if presence_penalty is not None:
            out = np.where(seen, out - presence_penalty, out)
        if frequency_penalty is not None:
            out = np.where(seen, out - frequency_penalty * counts, out)
    out = np.clip(out, -FLT_MAX, FLT_MAX)  # the kernel's clamp (NaN stays NaN, as there)
    if min_length > 0 and len(output) < min_length:
        if end_id is None or end_id < 0:
            raise RuntimeError(f"penaltyKernels.cu batchApplyPenalty: min length writes logits[endIds[slot]] "
                               f"unguarded; end id {end_id} is out of bounds")
        out[end_id] = -FLT_MAX
    return out


def sampled_log_prob(processed: Any, token: int, *, top_k: int, normalize_log_probs: bool) -> float:
    """The log probability ``topKStage2Sampling`` (cpp/tensorrt_llm/kernels/samplingTopKKernels.cu,
    03961722) writes for ``token`` when output log probs are asked: the sampling layer first turns
    the processed logits into probabilities over the whole vocabulary (layers/samplingLayer.cpp:
    ``invokeAddBiasSoftMax`` when ``mOutputLogProbs``, ``probsComputed``), then
    ``normalizeLogProbs ? log(p) - log(sum of the top-k p) : log(p)`` — "NOT normalized (same way
    as OpenAI does)" vs "log P(i | i is in top-k)". Greedy is top_k 1: normalised, always 0."""
    import numpy as np

    row = np.asarray(processed, dtype=np.float64)
    shifted = row - row.max()
    probs = np.exp(shifted) / np.exp(shifted).sum()
    log_p = float(np.log(probs[token]))
    if not normalize_log_probs:
        return log_p
    top = np.sort(probs)[::-1][:max(top_k, 1)]
    return log_p - float(np.log(top.sum()))


def write_engine_config(engine_dir: str | Path, *, tokens_per_block: int = 32, paged_context_fmha: bool = True,
                        context_fmha: bool = True, quant_algo: str | None = "FP8", kv_cache_quant_algo: str | None = "FP8",
                        tp_size: int = 1, vocab_size: int = 128256, logits_dtype: str | None = "float32",
                        max_input_len: int = 7168, max_seq_len: int = 8192, max_num_tokens: int = 8192) -> Path:
    """The fields of a trtllm-build ``config.json`` that runtime/gptJsonConfig.cpp reads and this double uses.

    ``logits_dtype`` None leaves the key out (gptJsonConfig.cpp createModelConfig then takes "float32").
    ``max_input_len`` / ``max_seq_len`` / ``max_num_tokens`` are ``build_config`` keys as trtllm-build's
    BuildConfig (tensorrt_llm/builder.py) writes them; gptJsonConfig.cpp reads ``max_input_len`` and
    ``max_num_tokens`` (optional) there — the snapshot in the index derives the sequence length from
    ``max_output_len``, so the key a 1.2 reader takes ``max_seq_len`` from is unconfirmed."""
    path = Path(engine_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "version": "1.2.1",
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "mapping": {"tp_size": tp_size, "pp_size": 1},
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo},
            "vocab_size": vocab_size,
            **({} if logits_dtype is None else {"logits_dtype": logits_dtype}),
        },
        "build_config": {"max_input_len": max_input_len, "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens,
                         "plugin_config": {
            "context_fmha": context_fmha, "use_paged_context_fmha": paged_context_fmha,
            "tokens_per_block": tokens_per_block, "paged_kv_cache": True, "remove_input_padding": True,
        }},
    }))
    return path


def _int(name: str, value: Any, *, optional: bool = False, lo: int | None = None, hi: int | None = None) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise TypeError(f"{name}: {value} out of range [{lo}, {hi}]")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected bool, got {type(value).__name__}")


def _float(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected float, got {type(value).__name__}")


def _duration(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(f"{name}: expected datetime.timedelta (std::chrono::milliseconds) or None, got {type(value).__name__}")


def make_module(*, salt_supported: bool = True, primary_blocks: int = 64, secondary_blocks: int = 256,
                version: str | None = "1.2.1", kv_cache_stats: bool = True, event_lag: int = 0) -> types.ModuleType:
    """A fresh fake module; ``module.calls`` records (class name, kwargs) of every construction.

    ``kv_cache_stats=False``: ``IterationStats.kv_cache_stats`` is None (``std::optional<KvCacheStats>``
    in executor/types.h; empty e.g. on a rank without a KV cache manager). ``event_lag``: how many
    ``get_latest_events`` calls miss an iteration's events before they arrive (the event manager's
    worker thread, ``fake_block_manager.FakeEventQueue``).
    """
    mod = types.ModuleType("tensorrt_llm.bindings.executor")
    if version is not None:
        mod.__version__ = version  # bindings.cpp: m.attr("__version__") = tle::version()
    calls: list[tuple[str, dict[str, Any]]] = []
    mod.calls = calls
    mod.executors = []

    class ModelType(enum.Enum):
        DECODER_ONLY = 0
        ENCODER_ONLY = 1
        ENCODER_DECODER = 2

    class KvCacheConfig:
        # executorConfig.cpp, newest snapshot before PR #12449 (which removed onboard_blocks on
        # main, 2026-03-23): ten positional-or-keyword arguments, then keyword-only ones.
        def __init__(self, enable_block_reuse=True, max_tokens=None, max_attention_window=None, sink_token_length=None,
                     free_gpu_memory_fraction=None, host_cache_size=None, onboard_blocks=True, cross_kv_cache_fraction=None,
                     secondary_offload_min_priority=None, event_buffer_max_size=0, *, enable_partial_reuse=True,
                     copy_on_partial_reuse=True, use_uvm=False, attention_dp_events_gather_period_ms=5,
                     runtime_defaults=None, max_gpu_total_bytes=0):
            _bool("enable_block_reuse", enable_block_reuse)
            _int("max_tokens", max_tokens, optional=True, lo=1)
            _float("free_gpu_memory_fraction", free_gpu_memory_fraction, optional=True)
            if free_gpu_memory_fraction is not None and not 0.0 < free_gpu_memory_fraction < 1.0:
                # KvCacheConfig::setFreeGpuMemoryFraction (executor/kvCacheConfig.cpp): TLLM_CHECK(> 0), (< 1)
                raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: freeGpuMemoryFraction < 1.F "
                                   f"(got {free_gpu_memory_fraction})")
            _int("host_cache_size", host_cache_size, optional=True, lo=0)  # std::optional<size_t>
            _bool("onboard_blocks", onboard_blocks)
            _int("secondary_offload_min_priority", secondary_offload_min_priority, optional=True, lo=0, hi=100)
            _int("event_buffer_max_size", event_buffer_max_size, lo=0)  # size_t
            _bool("enable_partial_reuse", enable_partial_reuse)
            _bool("copy_on_partial_reuse", copy_on_partial_reuse)
            self.__dict__.update({k: v for k, v in locals().items() if k != "self"})
            calls.append(("KvCacheConfig", {k: v for k, v in locals().items() if k not in ("self", "calls")}))

    _EXECUTOR_CONFIG_ARGS = {
        "max_beam_width", "scheduler_config", "kv_cache_config", "enable_chunked_context", "normalize_log_probs",
        "iter_stats_max_iterations", "request_stats_max_iterations", "batching_type", "max_batch_size", "max_num_tokens",
        "parallel_config", "peft_cache_config", "logits_post_processor_config", "decoding_config", "use_gpu_direct_storage",
        "gpu_weights_percent", "max_queue_size", "extended_runtime_perf_knob_config", "debug_config", "recv_poll_period_ms",
        "max_seq_idle_microseconds", "spec_dec_config", "guided_decoding_config", "additional_model_outputs",
        "cache_transceiver_config", "gather_generation_logits", "mm_embedding_offloading", "enable_trt_overlap",
        "fail_fast_on_attention_window_too_large",
    }

    class ExecutorConfig:
        def __init__(self, **kwargs):
            unknown = set(kwargs) - _EXECUTOR_CONFIG_ARGS
            if unknown:
                raise TypeError(f"ExecutorConfig: unexpected keyword(s) {sorted(unknown)}")
            _int("max_beam_width", kwargs.get("max_beam_width", 1), lo=1)
            if "kv_cache_config" in kwargs and not isinstance(kwargs["kv_cache_config"], KvCacheConfig):
                raise TypeError("kv_cache_config: expected KvCacheConfig")
            if "parallel_config" in kwargs and not isinstance(kwargs["parallel_config"], ParallelConfig):
                raise TypeError("parallel_config: expected ParallelConfig")
            if kwargs.get("guided_decoding_config") is not None and not isinstance(kwargs["guided_decoding_config"], GuidedDecodingConfig):
                raise TypeError("guided_decoding_config: expected GuidedDecodingConfig")
            for key in ("max_batch_size", "max_num_tokens", "max_queue_size"):
                _int(key, kwargs.get(key), optional=True, lo=1)
            _int("iter_stats_max_iterations", kwargs.get("iter_stats_max_iterations", 1000), lo=0)
            _bool("normalize_log_probs", kwargs.get("normalize_log_probs", True))
            self.__dict__.update(kwargs)
            calls.append(("ExecutorConfig", dict(kwargs)))

    class CommunicationMode(enum.Enum):
        LEADER = 0
        ORCHESTRATOR = 1

    class OrchestratorConfig:
        def __init__(self, is_orchestrator=True, worker_executable_path="", orch_leader_comm=None, spawn_processes=True):
            _bool("is_orchestrator", is_orchestrator)
            if not isinstance(worker_executable_path, str):
                raise TypeError("worker_executable_path: expected str")
            self.is_orchestrator, self.worker_executable_path = is_orchestrator, worker_executable_path
            calls.append(("OrchestratorConfig", dict(is_orchestrator=is_orchestrator, worker_executable_path=worker_executable_path)))

    class ParallelConfig:
        def __init__(self, communication_type=None, communication_mode=CommunicationMode.LEADER, device_ids=None,
                     participant_ids=None, orchestrator_config=None, num_nodes=None):
            if not isinstance(communication_mode, CommunicationMode):
                raise TypeError("communication_mode: expected CommunicationMode")
            if orchestrator_config is not None and not isinstance(orchestrator_config, OrchestratorConfig):
                raise TypeError("orchestrator_config: expected OrchestratorConfig")
            self.communication_mode, self.orchestrator_config = communication_mode, orchestrator_config
            calls.append(("ParallelConfig", dict(communication_mode=communication_mode, orchestrator_config=orchestrator_config)))

    class TokenRangeRetentionConfig:
        def __init__(self, token_start, token_end, priority, duration_ms=None):
            # SizeType32 / std::optional<SizeType32>: any int32 converts; the range rules are checked
            # by KvCacheRetentionConfig (below), the priority here.
            _int("token_start", token_start, lo=-(2**31), hi=2**31 - 1)
            _int("token_end", token_end, optional=True, lo=-(2**31), hi=2**31 - 1)
            _int("priority", priority, lo=-(2**31), hi=2**31 - 1)  # RetentionPriority = SizeType32
            # kvCacheRetentionConfig.cpp TokenRangeRetentionConfig ctor: TLLM_CHECK_WITH_INFO(priority in
            # [kMinRetentionPriority, kMaxRetentionPriority]) -> TllmException -> RuntimeError.
            if not 0 <= priority <= 100:
                raise RuntimeError("Invalid priority value. Must be between 0 and 100")
            _duration("duration_ms", duration_ms)
            self.token_start, self.token_end, self.priority, self.duration_ms = token_start, token_end, priority, duration_ms
            calls.append(("TokenRangeRetentionConfig", dict(token_start=token_start, token_end=token_end, priority=priority, duration_ms=duration_ms)))

    class KvCacheRetentionConfig:
        def __init__(self, token_range_retention_configs, decode_retention_priority=35, decode_duration_ms=None,
                     transfer_mode=None, directory=None):
            if not isinstance(token_range_retention_configs, list) or not all(
                isinstance(r, TokenRangeRetentionConfig) for r in token_range_retention_configs
            ):
                raise TypeError("token_range_retention_configs: expected list[TokenRangeRetentionConfig]")
            # RetentionPriority = SizeType32, and neither the binding (request.cpp: a plain nb::init) nor the
            # C++ constructor (kvCacheRetentionConfig.cpp, 3585984b) range-checks the decode priority: 101 is
            # accepted here (kvgate checks it itself: executor_args.retention_config).
            _int("decode_retention_priority", decode_retention_priority, lo=-(2**31), hi=2**31 - 1)
            _duration("decode_duration_ms", decode_duration_ms)
            # cpp/tensorrt_llm/executor/kvCacheRetentionConfig.cpp (KvCacheRetentionConfig ctor, NVIDIA/
            # TensorRT-LLM fbbc05dd): ranges sorted by start, then each throws std::invalid_argument
            # (nanobind: ValueError) in this order.
            ordered = sorted(token_range_retention_configs, key=lambda r: r.token_start)
            for i, r in enumerate(ordered):
                if r.token_end is None and i != len(ordered) - 1:
                    raise ValueError("Invalid use of end indicator.")
                if r.token_start < 0:
                    raise ValueError("Token indices must be non-negative.")
                if r.token_end is not None and r.token_start >= r.token_end:
                    raise ValueError("Range must have a positive, non-zero length.")
                if i != len(ordered) - 1 and r.token_end > ordered[i + 1].token_start:
                    raise ValueError("Token ranges must be non-overlapping.")
            self.token_range_retention_configs = token_range_retention_configs
            self.decode_retention_priority = decode_retention_priority
            self.decode_duration_ms = decode_duration_ms
            calls.append(("KvCacheRetentionConfig", dict(decode_retention_priority=decode_retention_priority,
                                                         decode_duration_ms=decode_duration_ms)))

    KvCacheRetentionConfig.TokenRangeRetentionConfig = TokenRangeRetentionConfig

    class SamplingConfig:
        def __init__(self, beam_width=1, *, top_k=None, top_p=None, top_p_min=None, top_p_reset_ids=None, top_p_decay=None,
                     seed=None, temperature=None, min_tokens=None, beam_search_diversity_rate=None, repetition_penalty=None,
                     presence_penalty=None, frequency_penalty=None, length_penalty=None, early_stopping=None,
                     no_repeat_ngram_size=None, num_return_sequences=None, min_p=None, beam_width_array=None):
            _int("beam_width", beam_width, lo=1)
            _int("top_k", top_k, optional=True)
            _float("top_p", top_p, optional=True)
            _float("temperature", temperature, optional=True)
            _int("seed", seed, optional=True, lo=0, hi=2**64 - 1)
            # cpp/tensorrt_llm/executor/samplingConfig.cpp checkTopK / checkTopP / checkTemperature:
            # TLLM_CHECK(topK >= 0), TLLM_CHECK(topP > 0 && topP <= 1), TLLM_CHECK(temperature >= 0).
            if top_k is not None and top_k < 0:
                raise RuntimeError("Assertion failed: topK.value() >= 0")
            if top_p is not None and not 0.0 < top_p <= 1.0:
                raise RuntimeError("Assertion failed: topP.value() > 0.f && topP.value() <= 1.f")
            if temperature is not None and temperature < 0.0:
                raise RuntimeError("Assertion failed: temperature.value() >= 0.f")
            # sampling: executor/samplingConfig.cpp checkRepetitionPenalty (TLLM_CHECK > 0 -> RuntimeError),
            # checkMinTokens (>= 0); presence/frequency penalties are unchecked floats.
            _float("repetition_penalty", repetition_penalty, optional=True)
            _float("presence_penalty", presence_penalty, optional=True)
            _float("frequency_penalty", frequency_penalty, optional=True)
            _int("min_tokens", min_tokens, optional=True, lo=-(2**31), hi=2**31 - 1)  # OptSize32
            if repetition_penalty is not None and not repetition_penalty > 0.0:
                raise RuntimeError("Repetition penalty should be strictly greater than zero.")
            if min_tokens is not None and min_tokens < 0:
                raise RuntimeError("min_tokens must be >= 0")
            self.repetition_penalty, self.presence_penalty = repetition_penalty, presence_penalty
            self.frequency_penalty, self.min_tokens = frequency_penalty, min_tokens
            self.repetition_penalty, self.presence_penalty = repetition_penalty, presence_penalty
            self.frequency_penalty, self.min_tokens = frequency_penalty, min_tokens
            self.beam_width, self.top_k, self.top_p, self.temperature, self.seed = beam_width, top_k, top_p, temperature, seed
            # What the decoding layers run: unset fields take DefaultDecodingParams, then regularizeTopKTopP.
            self.effective_top_k, self.effective_top_p = regularize_top_k_top_p(
                DEFAULT_TOP_K if top_k is None else top_k, DEFAULT_TOP_P if top_p is None else float(top_p))
            self.greedy = self.effective_top_k == 1
            calls.append(("SamplingConfig", dict(beam_width=beam_width, top_k=top_k, top_p=top_p, temperature=temperature, seed=seed,
                                                 repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                                 frequency_penalty=frequency_penalty, min_tokens=min_tokens)))

    class OutputConfig:
        def __init__(self, return_log_probs=False, return_context_logits=False, return_generation_logits=False,
                     exclude_input_from_output=False, return_encoder_output=False, return_perf_metrics=False,
                     additional_model_outputs=None):
            for name, value in (("exclude_input_from_output", exclude_input_from_output), ("return_perf_metrics", return_perf_metrics)):
                _bool(name, value)
            _bool("return_log_probs", return_log_probs)  # request.cpp OutputConfig: bool
            self.return_log_probs = return_log_probs
            self.exclude_input_from_output = exclude_input_from_output
            self.return_perf_metrics = return_perf_metrics
            calls.append(("OutputConfig", dict(exclude_input_from_output=exclude_input_from_output, return_perf_metrics=return_perf_metrics,
                                               return_log_probs=return_log_probs)))

    class GuideType(enum.Enum):  # request.cpp: GuidedDecodingParams.GuideType
        JSON = 0
        JSON_SCHEMA = 1
        REGEX = 2
        EBNF_GRAMMAR = 3
        STRUCTURAL_TAG = 4

    class GuidedDecodingParams:
        # request.cpp: nb::init<GuideType, std::optional<std::string>>(), guide_type, guide=None
        def __init__(self, guide_type, guide=None):
            if not isinstance(guide_type, GuideType):
                raise TypeError("guide_type: expected GuidedDecodingParams.GuideType")
            if guide is not None and not isinstance(guide, str):
                raise TypeError("guide: expected str or None")
            self.guide_type, self.guide = guide_type, guide
            calls.append(("GuidedDecodingParams", dict(guide_type=guide_type, guide=guide)))

    GuidedDecodingParams.GuideType = GuideType

    class GuidedDecodingBackend(enum.Enum):  # executorConfig.cpp: GuidedDecodingConfig.GuidedDecodingBackend
        XGRAMMAR = 0
        LLGUIDANCE = 1

    class GuidedDecodingConfig:
        # executorConfig.cpp: nb::init<GuidedDecodingBackend, optional<vector<string>>, optional<string>,
        # optional<vector<TokenIdType>>>(), backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None
        def __init__(self, backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None):
            if not isinstance(backend, GuidedDecodingBackend):
                raise TypeError("backend: expected GuidedDecodingConfig.GuidedDecodingBackend")
            if encoded_vocab is not None and not (isinstance(encoded_vocab, list) and all(isinstance(t, str) for t in encoded_vocab)):
                raise TypeError("encoded_vocab: expected list[str]")
            if tokenizer_str is not None and not isinstance(tokenizer_str, str):
                raise TypeError("tokenizer_str: expected str")
            if stop_token_ids is not None and not (isinstance(stop_token_ids, list) and all(isinstance(t, int) for t in stop_token_ids)):
                raise TypeError("stop_token_ids: expected list[int]")
            self.backend, self.encoded_vocab = backend, encoded_vocab
            self.tokenizer_str, self.stop_token_ids = tokenizer_str, stop_token_ids
            calls.append(("GuidedDecodingConfig", dict(backend=backend, vocab_size=len(encoded_vocab or []),
                                                       stop_token_ids=stop_token_ids)))

    GuidedDecodingConfig.GuidedDecodingBackend = GuidedDecodingBackend

    def _request_init(self, input_token_ids, max_tokens, *, streaming=False, sampling_config=NONE, output_config=NONE,
                      end_id=None, pad_id=None, position_ids=None, bad_words=None, stop_words=None, embedding_bias=None,
                      external_draft_tokens_config=None, prompt_tuning_config=None, multimodal_input=None,
                      multimodal_embedding=None, mrope_config=None, lora_config=None, lookahead_config=None,
                      kv_cache_retention_config=None, logits_post_processor_name=None, logits_post_processor=None,
                      encoder_input_token_ids=None, client_id=None, return_all_generated_tokens=False, priority=0.5,
                      type=None, context_phase_params=None, encoder_input_features=None, encoder_output_length=None,
                      cross_attention_mask=None, num_return_sequences=1, eagle_config=None, skip_cross_attn_blocks=None,
                      guided_decoding_params=None, language_adapter_uid=None, allotted_time_ms=None, cache_salt_id=None):
        if not isinstance(input_token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_token_ids):
            raise TypeError("input_token_ids: expected list[int] (VecTokens)")
        _int("max_tokens", max_tokens, lo=1)
        _bool("streaming", streaming)
        # std::optional<SizeType32>: any int32; the LLM API sends -1 for ignore_eos (executor/base_worker.py)
        _int("end_id", end_id, optional=True, lo=-(2**31), hi=2**31 - 1)
        if sampling_config is not NONE and not isinstance(sampling_config, SamplingConfig):
            raise TypeError("sampling_config: expected SamplingConfig")
        if output_config is not NONE and not isinstance(output_config, OutputConfig):
            raise TypeError("output_config: expected OutputConfig")
        if kv_cache_retention_config is not None and not isinstance(kv_cache_retention_config, KvCacheRetentionConfig):
            raise TypeError("kv_cache_retention_config: expected KvCacheRetentionConfig")
        _int("cache_salt_id", cache_salt_id, optional=True, lo=0, hi=2**64 - 1)  # CacheSaltIDType = std::uint64_t
        # request.cpp: embedding_bias std::optional<Tensor> (a torch tensor from Python),
        # guided_decoding_params std::optional<GuidedDecodingParams>.
        if embedding_bias is not None:
            import torch

            if not isinstance(embedding_bias, torch.Tensor):
                raise TypeError("embedding_bias: expected a Tensor")
        if guided_decoding_params is not None and not isinstance(guided_decoding_params, GuidedDecodingParams):
            raise TypeError("guided_decoding_params: expected GuidedDecodingParams")
        self.embedding_bias = embedding_bias
        self.guided_decoding_params = guided_decoding_params
        self.input_token_ids = input_token_ids
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.sampling_config = None if sampling_config is NONE else sampling_config
        self.output_config = OutputConfig() if output_config is NONE else output_config
        self.end_id = end_id
        self.kv_cache_retention_config = kv_cache_retention_config
        self.cache_salt_id = cache_salt_id
        calls.append(("Request", dict(input_token_ids=input_token_ids, max_tokens=max_tokens, streaming=streaming,
                                      end_id=end_id, cache_salt_id=cache_salt_id)))

    if salt_supported:
        Request = type("Request", (), {"__init__": _request_init})
    else:
        def _init_without_salt(self, input_token_ids, max_tokens, **kwargs):
            if "cache_salt_id" in kwargs:
                raise TypeError("__init__(): incompatible function arguments")  # what nanobind says
            _request_init(self, input_token_ids, max_tokens, **kwargs)
        Request = type("Request", (), {"__init__": _init_without_salt})

    class KvCacheMetrics:
        def __init__(self, total=0, new=0, reused=0, missed=0):
            self.num_total_allocated_blocks, self.num_new_allocated_blocks = total, new
            self.num_reused_blocks, self.num_missed_blocks = reused, missed
            self.kv_cache_hit_rate = reused / total if total else 0.0

    class RequestPerfMetrics:
        def __init__(self, kv):
            self.kv_cache_metrics = kv

    class FinishReason(enum.Enum):  # request.cpp (nanobind): nb::enum_<tle::FinishReason>(m, "FinishReason")
        NOT_FINISHED = 0
        END_ID = 1
        STOP_WORDS = 2
        LENGTH = 3
        TIMED_OUT = 4
        CANCELLED = 5

    class Result:
        def __init__(self, tokens, is_final, perf, log_probs=None, finish_reason=None):
            self.output_token_ids = [list(tokens)]
            self.is_final = is_final
            self.request_perf_metrics = perf
            # request.cpp: Result.log_probs, std::optional<vector<vector<float>>> (per beam), None unless asked
            self.log_probs = None if log_probs is None else [list(log_probs)]
            # request.cpp: Result.finish_reasons, one per beam (llmRequest.cpp createResult: mFinishReasons)
            self.finish_reasons = [finish_reason or (FinishReason.LENGTH if is_final else FinishReason.NOT_FINISHED)]

    class Response:
        def __init__(self, request_id, result=None, error_msg=""):
            self.request_id = request_id
            self._result = result
            self.error_msg = error_msg

        def has_error(self):
            return self._result is None

        @property
        def result(self):
            if self._result is None:
                raise RuntimeError("response has an error")
            return self._result

    kv_cache = types.ModuleType("tensorrt_llm.bindings.executor.kv_cache")

    class UniqueToken:
        def __init__(self, token_id):
            self.token_id, self.token_extra_id = token_id, 0

    class KVCacheCreatedData:
        def __init__(self, levels):
            self.num_blocks_per_cache_level = levels

    class KVCacheStoredBlockData:
        def __init__(self, block_hash, tokens, cache_level, priority, lora_id=None):
            self.block_hash, self.tokens, self.cache_level, self.priority = block_hash, tokens, cache_level, priority
            self.lora_id = lora_id

    class KVCacheStoredData:
        def __init__(self, parent_hash, blocks):
            self.parent_hash, self.blocks = parent_hash, blocks

    class KVCacheRemovedData:
        def __init__(self, block_hashes):
            self.block_hashes = block_hashes

    class KVCacheEventDiffInt:
        def __init__(self, old_value, new_value):
            self.old_value, self.new_value = old_value, new_value

    class KVCacheUpdatedData:
        def __init__(self, block_hash, cache_level=None, priority=None):
            self.block_hash, self.cache_level, self.priority = block_hash, cache_level, priority

    class KVCacheEvent:
        def __init__(self, event_id, data, window_size=0, attention_dp_rank=None):
            self.event_id, self.data, self.window_size = event_id, data, window_size
            self.attention_dp_rank = attention_dp_rank

    for cls in (UniqueToken, KVCacheCreatedData, KVCacheStoredBlockData, KVCacheStoredData, KVCacheRemovedData,
                KVCacheEventDiffInt, KVCacheUpdatedData, KVCacheEvent):
        setattr(kv_cache, cls.__name__, cls)

    class KVCacheEventManager:
        """executor.h ``KVCacheEventManager`` wraps the KV cache manager (executorImpl.cpp); its
        ``get_latest_events`` is ``BlockManager::getLatestEvents`` (batch_manager/kvCacheManager.cpp):
        empty when the block manager has no event manager, i.e. ``event_buffer_max_size == 0``
        (trtGptModelInflightBatching.cpp createKvCacheManager: ``getEventBufferMaxSize() > 0 ?
        make_unique<KVCacheEventManager>(...) : nullptr``). Queueing, flushing, the buffer bound and
        the worker's delay: ``fake_block_manager.FakeEventQueue``."""

        def __init__(self, buffer_max_size):
            self.buffer_max_size = buffer_max_size
            self.queue = FakeEventQueue(buffer_max_size, lambda event_id, data: KVCacheEvent(event_id, data),
                                        lag=event_lag)

        def get_latest_events(self, timeout_ms=None):
            _float("timeout_ms", timeout_ms, optional=True)
            return self.queue.take()

    class KvCacheStats:
        def __init__(self, **values):
            self.__dict__.update(values)

    class IterationStats:
        def __init__(self, kv_cache_stats):
            self.kv_cache_stats = kv_cache_stats

    def _read_engine(model_path):
        # runtime/gptJsonConfig.cpp: GptJsonConfig::parse(path) checks the file exists
        # (TLLM_CHECK_WITH_INFO "File does not exist"), then reads build_config.plugin_config.
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: File does not exist: {path}")
        plugin = json.loads(path.read_text())["build_config"]["plugin_config"]
        return bool(plugin["use_paged_context_fmha"]), int(plugin["tokens_per_block"])

    def _read_limits(model_path):
        """(context FMHA, packed input, max_input_len, max_seq_len, max_num_tokens) of the engine's config.json
        (build_config and its plugin_config; gptJsonConfig.cpp: max_num_tokens optional, remove_input_padding
        is ModelConfig::usePackedInput)."""
        build = json.loads((Path(model_path) / "config.json").read_text())["build_config"]
        plugin = build["plugin_config"]
        return (bool(plugin["context_fmha"]), bool(plugin["remove_input_padding"]), int(build["max_input_len"]),
                int(build["max_seq_len"]), build.get("max_num_tokens"))

    def _read_logits(model_path):
        # runtime/gptJsonConfig.cpp createModelConfig: pretrained_config.vocab_size (required),
        # logits_dtype (default "float32"; only float32/float16, else "Unsupported logits data type");
        # runtime/modelConfig.h getVocabSizePadded(worldSize) rounds up to the world size (tp * pp * cp).
        pretrained = json.loads((Path(model_path) / "config.json").read_text())["pretrained_config"]
        logits_dtype = pretrained.get("logits_dtype", "float32")
        if logits_dtype not in ("float32", "float16"):
            raise RuntimeError("[TensorRT-LLM][ERROR] Unsupported logits data type")
        mapping = pretrained.get("mapping", {})
        world = mapping.get("tp_size", 1) * mapping.get("pp_size", 1) * mapping.get("cp_size", 1)
        vocab = int(pretrained["vocab_size"])
        return logits_dtype, vocab, (vocab + world - 1) // world * world

    def _decoder_request_error(executor, request):
        """What batch_manager/createNewDecoderRequests.cpp throws for this request (an error Response:
        the executor reports a failure of the decoder setup to the request, not to the caller of
        enqueue_request), or None."""
        bias = request.embedding_bias
        if bias is not None:
            dtype = str(bias.dtype).removeprefix("torch.")
            if dtype != executor.logits_dtype:
                # getEmbeddingBias: FP32 for FP16 logits is converted (CPU tensors of shape [1, V] only),
                # anything else is TLLM_THROW.
                if not (dtype == "float32" and executor.logits_dtype == "float16"):
                    return "[TensorRT-LLM][ERROR] Embedding bias data type must be same as model logits type."
                executor.warnings.append("Embedding bias data type must be same as model logits type, will copy the "
                                         "tensor from float to half")
                if bias.device.type != "cpu":
                    return "[TensorRT-LLM][ERROR] Embedding bias tensor needs to be in CPU memory for casting"
            # initializeEmbeddingBias: TLLM_CHECK(nbDims == 2), TLLM_CHECK(d[0] == 1), d[1] == getVocabSize()
            if bias.dim() != 2:
                return "[TensorRT-LLM][ERROR] Assertion failed: embeddingBiasTensor->getShape().nbDims == 2"
            if bias.shape[0] != 1:
                return "[TensorRT-LLM][ERROR] Assertion failed: embeddingBiasTensor->getShape().d[0] == 1"
            if bias.shape[1] != executor.vocab_size:
                return ("[TensorRT-LLM][ERROR] The embedding bias shape is not as expected. Expected last dimension "
                        f"to be same as vocab size: {executor.vocab_size}.")
            # BufferManager::copy into the request's row of the joint buffer (vocabSizePadded wide)
            if executor.vocab_size != executor.vocab_size_padded:
                return "[TensorRT-LLM][ERROR] Incompatible buffer sizes"
        sampling = request.sampling_config
        if sampling is not None and sampling.min_tokens and request.end_id is not None and request.end_id < 0:
            # penaltyKernels.cu batchApplyPenalty writes outLogitsPtr[endIds[batchSlot]] unguarded: with end
            # id -1 the real kernel writes out of bounds (undefined behaviour); the double refuses loudly.
            return ("double: penaltyKernels.cu min-length mask would write logits[-1] (end_id -1 with min_tokens): "
                    "undefined behaviour on a GPU")
        return None

    class Executor:
        def __init__(self, model_path, model_type, executor_config):
            if not isinstance(model_type, ModelType):
                raise TypeError("model_type: expected ModelType")
            if not isinstance(executor_config, ExecutorConfig):
                raise TypeError("executor_config: expected ExecutorConfig")
            self.model_path, self.model_type, self.config = model_path, model_type, executor_config
            self.paged_context_fmha, self.tokens_per_block = _read_engine(model_path)
            self.logits_dtype, self.vocab_size, self.vocab_size_padded = _read_logits(model_path)
            kv_config = getattr(executor_config, "kv_cache_config", None)
            if kv_config is None:  # executor.h KvCacheConfig defaults
                kv_config = types.SimpleNamespace(onboard_blocks=True, enable_block_reuse=True, event_buffer_max_size=0,
                                                  enable_partial_reuse=True, copy_on_partial_reuse=True)
            orchestrator = getattr(executor_config, "parallel_config", None) is not None and \
                executor_config.parallel_config.communication_mode is CommunicationMode.ORCHESTRATOR
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
            context_fmha, packed, engine_input_len, self.max_seq_len, max_num_tokens = _read_limits(model_path)
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
            self.iter_stats_max_iterations = getattr(executor_config, "iter_stats_max_iterations", 1000)
            # executorConfig.cpp (nanobind) ExecutorConfig init: nb::arg("normalize_log_probs") = true
            self.normalize_log_probs = getattr(executor_config, "normalize_log_probs", True)
            self.lock = threading.Lock()
            self.ready: deque = deque()
            self.requests: dict[int, Any] = {}
            self.cancelled: list[int] = []
            self.active: dict[int, _Active] = {}  # enqueued, not finished (scheduled at the next iteration)
            self.auto_run = True  # await_responses runs iterations until every request finished
            self.next_id = 1
            self.reused_total = self.alloc_total = self.alloc_new = self.missed_total = self.slots_used = 0
            self.iteration_stats: deque = deque(maxlen=max(self.iter_stats_max_iterations, 1))
            self.events = KVCacheEventManager(kv_config.event_buffer_max_size)
            self.blocks = FakeBlockManager(self.tokens_per_block, enable_block_reuse=self.block_reuse,
                                           enqueue_stored=self._stored, enqueue_removed=self._removed,
                                           enable_partial_reuse=kv_config.enable_partial_reuse,
                                           copy_on_partial_reuse=kv_config.copy_on_partial_reuse)
            # kvCacheManager.cpp WindowBlockManager ctor: enqueueCreatedEvent. Flushed at once here (the real
            # one waits for the first iteration's flush) so a stats call before any request sees the sizes.
            self._event(KVCacheCreatedData([primary_blocks, secondary_blocks]))
            self.events.queue.flush()
            self.shut = False
            mod.executors.append(self)

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
            self._event(KVCacheStoredData(parent_hash, [
                KVCacheStoredBlockData(b.block_hash, [UniqueToken(t) for t in b.tokens], b.level, 35) for b in blocks]))

        def _removed(self, block_hash):
            if self.events.buffer_max_size:
                self.events.queue.enqueue_removed(block_hash, KVCacheRemovedData)

        def enqueue_request(self, request):
            if not isinstance(request, Request):
                raise TypeError("request: expected Request")
            with self.lock:
                request_id = self.next_id
                self.next_id += 1
                self.requests[request_id] = request
                self._run(request_id, request)
            return request_id

        def _run(self, request_id, request):
            """Plan the request's tokens and responses; blocks are matched, stored and released by ``step``."""
            # executorImpl.cpp fetchNewRequests: newReq->validate(mModel->getMaxInputLen(), ...) before anything else;
            # its exception becomes the request's error Response (see FETCH_ERROR).
            if len(request.input_token_ids) > self.max_input_len:
                message = PROMPT_TOO_LONG.format(len(request.input_token_ids), self.max_input_len)
                self.ready.append(Response(request_id, None, FETCH_ERROR + message + LLM_REQUEST_THROW_AT))
                return
            error = _decoder_request_error(self, request)
            if error is not None:
                self.ready.append(Response(request_id, None, error))
                return
            # KvCacheMetrics are filled in when the request is scheduled (KVCacheManager::addSequence).
            metrics = RequestPerfMetrics(KvCacheMetrics())
            ids = request.input_token_ids
            sampling = request.sampling_config  # None: every field unset -> (0, 0.0) -> greedy
            # Greedy decoding gives the deterministic tokens; sampling (what regularizeTopKTopP leaves
            # non-greedy) gives different ones, so a test can tell the two apart from the output.
            greedy = sampling is None or sampling.greedy
            shift = 0 if greedy else 1 + (sampling.seed or 0) % 999  # never a multiple of 1000: never greedy's tokens
            generated = [(t * 7 + 3 + shift) % 1000 + 10 for t in ids][: request.max_tokens]
            if request.end_id is not None and request.end_id >= 0 and len(generated) < request.max_tokens:
                generated.append(request.end_id)
            # Simulated log probabilities: -0.5 - 0.01 * token, returned only with return_log_probs.
            # ExecutorConfig.normalize_log_probs (binding default true, executorConfig.cpp) is copied
            # into each request (batch_manager/createNewDecoderRequests.cpp: samplingConfig.normalizeLogProbs
            # = mIsNormalizeLogProbs) and topKStage2Sampling (samplingTopKKernels.cu) then returns log P
            # within the top-k set: for a greedy (top-k 1) request exactly 0.0 per token (sampled_log_prob).
            asked = request.output_config.return_log_probs
            normalized_greedy = greedy and self.normalize_log_probs
            lps = [0.0 if normalized_greedy else -0.5 - 0.01 * t for t in generated]
            planned = []
            ended = request.end_id is not None and bool(generated) and generated[-1] == request.end_id
            reason = FinishReason.END_ID if ended else FinishReason.LENGTH
            if request.streaming:
                for i, token in enumerate(generated):
                    last = i == len(generated) - 1
                    planned.append(Response(request_id, Result([token], last, metrics, lps[i:i + 1] if asked else None,
                                                               reason if last else None)))
            else:
                planned.append(Response(request_id, Result(generated, True, metrics, lps if asked else None, reason)))
            self.active[request_id] = _Active(request, generated, planned, metrics.kv_cache_metrics)

        def step(self):
            """One iteration (trtGptModelInflightBatching.cpp forwardAsync + forwardSync) over every active request.

            Scheduling admits everything (no capacity model). Order, as in the C++: new requests get their
            sequence (KVCacheManager::addSequence: reuse matching, per-request KV metrics); forwardAsync stores
            context blocks of requests whose context ran and the newest block of requests in generation;
            forwardSync appends each request's next token and releases finished (or cancelled) requests,
            storing their blocks; responses go out; flushIterationEvents hands the events over.
            """
            with self.lock:
                self._step()

        def _step(self):
            blocks = self.blocks
            for request_id, active in self.active.items():
                if request_id in self.cancelled or active.scheduled:
                    continue
                request = active.request
                reused, context = blocks.add_sequence(request_id, request.input_token_ids, request.cache_salt_id)
                kv = active.kv
                kv.num_total_allocated_blocks, kv.num_reused_blocks = context, reused
                kv.num_missed_blocks = context - reused
                # getFreeBlock (kvCacheManager.cpp): ++mAllocNewBlocks only for a slot whose uniqueTokens are
                # empty, i.e. never used (a block's key is never cleared): at most the pool's size per life
                fresh = min(context - reused, max(0, primary_blocks - self.slots_used))
                self.slots_used += fresh
                kv.num_new_allocated_blocks = fresh
                kv.kv_cache_hit_rate = reused / context if context else 0.0
                self.reused_total += reused
                self.alloc_total += context
                self.alloc_new += fresh  # KvCacheStats.alloc_new_blocks is mAllocNewBlocks: the same getFreeBlock rule
                self.missed_total += context - reused
            for request_id, active in self.active.items():  # forwardAsync
                if request_id in self.cancelled:
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
                    self.ready.append(Response(request_id, Result([], True, RequestPerfMetrics(active.kv),
                                                                  [] if asked else None, FinishReason.CANCELLED)))
                    finished.append(request_id)
                    continue
                if active.produced < len(active.generated):
                    blocks.add_token(request_id, active.generated[active.produced])
                    active.produced += 1
                if active.request.streaming:
                    self.ready.append(active.planned[active.produced - 1])
                if active.produced == len(active.generated):
                    if not active.request.streaming:
                        self.ready.append(active.planned[0])
                    finished.append(request_id)
            for request_id in finished:
                blocks.release(request_id)
                del self.active[request_id]
            self.iteration_stats.append(IterationStats(self._kv_stats() if kv_cache_stats else None))
            self.events.queue.flush()

        def _kv_stats(self):
            # kvCacheManager.h KvCacheStats (00825c4e): freeNumBlocks = free blocks of the primary pool,
            # usedNumBlocks = maxNumBlocks - freeNumBlocks. evictionPolicy.cpp LRUEvictionPolicy::releaseBlock
            # counts every released block as free (mNumFreeBlocksPerLevel++), the blocks kept in the reuse tree
            # included; claimBlock takes one off. So "used" is what running requests hold, and a cached block
            # is free. The double has no capacity model (it admits everything): used is capped at the pool.
            used = min(self.blocks.blocks_in_use(), primary_blocks)
            return KvCacheStats(
                max_num_blocks=primary_blocks, free_num_blocks=primary_blocks - used,
                used_num_blocks=used, tokens_per_block=self.tokens_per_block,
                alloc_total_blocks=self.alloc_total, alloc_new_blocks=self.alloc_new, reused_blocks=self.reused_total,
                missed_blocks=self.missed_total,
                cache_hit_rate=self.reused_total / self.alloc_total if self.alloc_total else 0.0,
            )

        def await_responses(self, timeout=None):
            _duration("timeout", timeout)
            while self.auto_run and self.active:  # the executor's own loop; tests set auto_run False to step
                self.step()
            # executorImpl.cpp awaitResponses hands over every queued Response: a request cancelled after some of
            # its responses were produced still delivers them, then its final CANCELLED one.
            with self.lock:
                out = list(self.ready)
                self.ready.clear()
            return out

        def cancel_request(self, id=None):
            _int("id", id, lo=0)
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
            self._event(KVCacheUpdatedData(block_hash, KVCacheEventDiffInt(0, 1), None))
            self.events.queue.flush()

        def onboard(self, block_hash):
            self.tree[block_hash].level = 0
            self._event(KVCacheUpdatedData(block_hash, KVCacheEventDiffInt(1, 0), None))
            self.events.queue.flush()

        def evict(self, block_hash):
            self.blocks.evict(block_hash)
            self.events.queue.flush()

    for obj in (CommunicationMode, OrchestratorConfig, ParallelConfig, ModelType, KvCacheConfig, ExecutorConfig, KvCacheRetentionConfig, SamplingConfig, OutputConfig, Request,
                Response, Result, FinishReason, KvCacheStats, IterationStats, Executor, GuidedDecodingParams,
                GuidedDecodingConfig):
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
