"""Serving parameters → ``KvCacheConfig`` / ``ExecutorConfig`` / ``Request`` for the 1.2 executor.

Keyword names and types follow the 1.2-era bindings (``cpp/tensorrt_llm/nanobind/executor/
executorConfig.cpp`` and ``request.cpp``, read in main-branch snapshots from before and
after the release/1.2 branch point; see docs/architecture.md "Production path"); the C++
defaults they would otherwise take are in ``cpp/include/tensorrt_llm/executor/executor.h``.
Every field kvgate cares about is passed explicitly — notably
``secondary_offload_min_priority`` (code default 30, docs 35) — so no default of either
source decides a tenant's fate. ``KvCacheConfig`` has no dtype: the KV dtype (FP8) is fixed
in the engine at build time (``quantize.py --kv_cache_dtype fp8``).

Durations: the bindings take ``std::chrono::milliseconds`` (nanobind ``stl/chrono.h``),
i.e. :class:`datetime.timedelta` in Python, not an int of milliseconds.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from types import ModuleType
from typing import Any

from engines.contract import DECODE_DURATION, DECODE_PRIORITY, RANGE_DURATIONS, ContractError, EngineRequest
from engines.trtllm import request_extensions
from engines.trtllm.bindings import BindingError
from engines.trtllm.engine_config import BiasLayout
from retention.types import DEFAULT_PRIORITY, RetentionPlan, TokenRange


def kv_cache_config_kwargs(params: Any) -> dict[str, Any]:
    """Keyword arguments for ``KvCacheConfig`` (executorConfig.cpp, ``nb::init<...>`` arg names)."""
    kwargs: dict[str, Any] = {
        "enable_block_reuse": params.enable_block_reuse,
        "free_gpu_memory_fraction": params.free_gpu_memory_fraction,
        "host_cache_size": params.host_cache_size,
        "secondary_offload_min_priority": params.secondary_offload_min_priority,
        "event_buffer_max_size": params.event_buffer_max_size,
        "enable_partial_reuse": params.enable_partial_reuse,  # keyword-only in the binding
        "copy_on_partial_reuse": params.copy_on_partial_reuse,  # keyword-only in the binding
    }
    if params.max_tokens is not None:
        kwargs["max_tokens"] = params.max_tokens
    if not params.onboard_blocks:
        # Passed only to turn onboarding off: the binding's default is true, and PR #12449
        # (merged to main 2026-03-23, after the release/1.2 branch) removed the argument.
        # Every pre-#12449 snapshot of executorConfig.cpp has it as the 7th positional
        # keyword; the 1.2.1 tag itself was not read. A build without it raises TypeError
        # at start-up (make_executor names the keyword) instead of ignoring the setting.
        kwargs["onboard_blocks"] = False
    return kwargs


def executor_config_kwargs(params: Any, kv_cache_config: Any) -> dict[str, Any]:
    """Keyword arguments for ``ExecutorConfig`` (executorConfig.cpp)."""
    kwargs: dict[str, Any] = {
        "max_beam_width": 1,
        "kv_cache_config": kv_cache_config,
        "iter_stats_max_iterations": params.iter_stats_max_iterations,
        "max_batch_size": params.max_batch_size,
        "max_num_tokens": params.max_num_tokens,
        # The contract's log probabilities are of the whole processed distribution (engines/contract.py).
        # The binding's default is true (nanobind/executor/executorConfig.cpp ExecutorConfig init:
        # nb::arg("normalize_log_probs") = true, and py::arg(...) = true in the pybind twin, in every
        # snapshot of the index; a later flip on main would not change 1.2.1);
        # CreateNewDecoderRequests copies it into every request's SamplingConfig and
        # samplingTopKKernels.cu topKStage2Sampling then reports log P within the top-k set:
        # 0.0 for every greedy (top-k 1) token. Always sent, so neither default decides.
        "normalize_log_probs": False,
        # The spec allows max_num_tokens < max_input_len. Without chunked context (the binding's default:
        # nanobind/executor/executorConfig.cpp nb::arg("enable_chunked_context") = false) an engine with
        # context FMHA and packed input takes at most min(max_seq_len - 1, max_num_tokens) prompt tokens
        # (batch_manager/trtGptModel.h) and refuses longer prompts ("Prompt length (%d) exceeds maximum input
        # length (%d)", batch_manager/llmRequest.cpp); with it the limit is max_seq_len - 1 and a long prompt
        # runs in chunks of tokens_per_block multiples (trtGptModelInflightBatching.cpp: chunkUnitSize =
        # tokens per block; microBatchScheduler.cpp). It needs paged context FMHA, without which the executor
        # drops it with a warning (executorImpl.cpp fixExecutorConfig): engine_config.check_chunked_context.
        "enable_chunked_context": True,
    }
    if params.max_queue_size is not None:
        kwargs["max_queue_size"] = params.max_queue_size
    return kwargs


def parallel_config(trtllm: ModuleType, params: Any) -> Any | None:
    """Orchestrator mode for multi-GPU engines, None for one GPU (leader mode, the default).

    ``ParallelConfig(communication_mode=CommunicationMode.ORCHESTRATOR, orchestrator_config=
    OrchestratorConfig(is_orchestrator=True, worker_executable_path=...))`` — executorConfig.cpp;
    the stock tensorrt_llm Python model (tensorrtllm_backend all_models/inflight_batcher_llm/
    tensorrt_llm/1/model.py, get_parallel_config) does the same under TRTLLM_ORCHESTRATOR=1.
    """
    if params.world_size == 1:
        return None
    return trtllm.ParallelConfig(
        communication_mode=trtllm.CommunicationMode.ORCHESTRATOR,
        orchestrator_config=trtllm.OrchestratorConfig(is_orchestrator=True, worker_executable_path=params.executor_worker_path),
    )


def make_executor(trtllm: ModuleType, params: Any, *, guided_decoding_config: Any = None) -> Any:
    """``Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig(...))`` (nanobind/executor/executor.cpp)."""
    kv_kwargs = kv_cache_config_kwargs(params)
    try:
        kv_cache_config = trtllm.KvCacheConfig(**kv_kwargs)
    except TypeError as exc:  # a binding that lacks one of our keywords: say which, do not guess
        raise BindingError(f"KvCacheConfig rejected keywords {sorted(kv_kwargs)}: {exc}") from exc
    kwargs = executor_config_kwargs(params, kv_cache_config)
    parallel = parallel_config(trtllm, params)
    if parallel is not None:
        kwargs["parallel_config"] = parallel
    if guided_decoding_config is not None:  # executorConfig.cpp: ExecutorConfig(guided_decoding_config=)
        kwargs["guided_decoding_config"] = guided_decoding_config
    try:
        executor_config = trtllm.ExecutorConfig(**kwargs)
    except TypeError as exc:
        raise BindingError(f"ExecutorConfig rejected keywords {sorted(kwargs)}: {exc}") from exc
    return trtllm.Executor(params.engine_dir, trtllm.ModelType.DECODER_ONLY, executor_config)


def _duration(ms: int | None) -> timedelta | None:
    return None if ms is None else timedelta(milliseconds=ms)


# The end sent for an open-ended range: SizeType32 max. The 1.2-era binding refuses token_end=None
# (NVIDIA/TensorRT-LLM ac456dca cpp/tensorrt_llm/nanobind/executor/request.cpp: nb::arg("token_end")
# without .none()), and the C++ only ever tests ``tokenLoc >= tokenEnd``
# (cpp/tensorrt_llm/executor/kvCacheRetentionConfig.cpp getPerBlockRetentionPriorityDuration), so
# this end covers every token an open end would. Never the prompt length: generated tokens past it
# would fall out of the range.
OPEN_END_TOKEN = 2**31 - 1

# KvCacheRetentionConfig's ``directory``: the C++ constructor's default (cpp/include/tensorrt_llm/
# executor/executor.h), read only by the GDS / POSIX transfer modes (kvgate uses DRAM, the default).
# Always passed: ac456dca request.cpp binds it as a plain std::string with nb::arg default nb::none(),
# so omitting it is a TypeError there; bindings taking std::optional<std::string> accept "" too.
RETENTION_DIRECTORY = ""


def retention_config(trtllm: ModuleType, plan: RetentionPlan) -> Any | None:
    """``KvCacheRetentionConfig`` for ``plan`` (None for the default plan: nothing to say).

    ``TokenRangeRetentionConfig(token_start, token_end, priority, duration_ms)``: an open-ended
    range (``end`` None in the plan) is sent with ``token_end`` :data:`OPEN_END_TOKEN`;
    ``duration_ms`` None never expires (request.cpp; semantics in executor.h). The decode
    priority/duration apply to generated blocks. ``directory`` is always :data:`RETENTION_DIRECTORY`.
    """
    if not plan.ranges and plan.decode_priority == DEFAULT_PRIORITY and plan.decode_duration_ms is None:
        return None
    check_retention_gaps(plan)
    token_range = trtllm.KvCacheRetentionConfig.TokenRangeRetentionConfig
    ranges = [
        token_range(token_start=r.start, token_end=OPEN_END_TOKEN if r.end is None else r.end, priority=r.priority,
                    duration_ms=_duration(r.duration_ms))
        for r in plan.ranges
    ]
    return trtllm.KvCacheRetentionConfig(
        token_range_retention_configs=ranges,
        decode_retention_priority=plan.decode_priority,
        decode_duration_ms=_duration(plan.decode_duration_ms),
        directory=RETENTION_DIRECTORY,
    )


# Two ranges (one open-ended, one with a duration) and a decode priority with a duration: every
# argument shape retention_config sends.
REPRESENTATIVE_RETENTION_PLAN = RetentionPlan(
    (TokenRange(0, 64, 90, 30_000), TokenRange(64, None, 20, None)), decode_priority=10, decode_duration_ms=1_000,
)


def check_retention_binding(trtllm: ModuleType) -> None:
    """Build :data:`REPRESENTATIVE_RETENTION_PLAN`'s config once, at load.

    A binding that refuses what :func:`retention_config` sends (a keyword, a type) then stops the model
    with a :class:`BindingError` naming it, instead of failing every retained request.
    """
    try:
        retention_config(trtllm, REPRESENTATIVE_RETENTION_PLAN)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BindingError(
            f"KvCacheRetentionConfig / TokenRangeRetentionConfig refused kvgate's retention config "
            f"(token_end={OPEN_END_TOKEN} for an open end, directory={RETENTION_DIRECTORY!r}): {exc}"
        ) from exc


def check_retention_gaps(plan: RetentionPlan) -> None:
    """What the 1.2 bindings would accept silently, refused by name before they see it.

    Checked by TensorRT-LLM (cpp/tensorrt_llm/executor/kvCacheRetentionConfig.cpp, read at
    3585984b): a range's priority in [kMinRetentionPriority, kMaxRetentionPriority] = [0, 100]
    (``TLLM_CHECK_WITH_INFO`` in the ``TokenRangeRetentionConfig`` constructor → RuntimeError
    "Invalid priority value. Must be between 0 and 100"), and in the ``KvCacheRetentionConfig``
    constructor, after sorting by start, ``std::invalid_argument`` (→ ValueError) for an open end
    that is not last, a negative start, an empty range and overlapping ranges. Not checked at
    construction: the decode priority (a plain ``RetentionPriority``, no check in the constructor
    or the nanobind/pybind ``init``) and the durations' sign — so kvgate checks those here.
    """
    if not 0 <= plan.decode_priority <= 100:
        raise ContractError(f"retention_decode_priority must be within [0, 100], got {plan.decode_priority} "
                            "(TensorRT-LLM does not check it)", tensor=DECODE_PRIORITY.name)
    if plan.decode_duration_ms is not None and plan.decode_duration_ms < 0:
        raise ContractError(f"retention_decode_duration_ms must be >= 0, got {plan.decode_duration_ms}",
                            tensor=DECODE_DURATION.name)
    for index, rng in enumerate(plan.ranges):
        if rng.duration_ms is not None and rng.duration_ms < 0:
            raise ContractError(f"retention range {index}: duration must be >= 0, got {rng.duration_ms}",
                                tensor=RANGE_DURATIONS.name)


def cache_salt_id(salt: str) -> int:
    """The executor's ``cacheSaltID`` (``CacheSaltIDType = std::uint64_t``, executor/types.h) for a salt string.

    Only kvgate's model feeds this executor, so any stable 64-bit digest isolates tenants;
    blake2b keeps it stdlib-only. TensorRT-LLM mixes the id into the root block key only
    (``batch_manager/blockKey.cpp``); descendants inherit it through the parent hash.
    """
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest(), "little")


class SaltUnsupportedError(RuntimeError):
    """A salted request reached an executor build whose ``Request`` has no ``cache_salt_id``."""


def sampling_config(trtllm: ModuleType, request: EngineRequest) -> Any:
    """``SamplingConfig(beam_width=1, *, top_k=, top_p=, temperature=, seed=)`` (request.cpp).

    ``top_k`` and ``top_p`` are always passed. An unset field is not "no cut": the decoding
    layers read ``DefaultDecodingParams`` (cpp/tensorrt_llm/layers/defaultDecodingParams.h:
    ``getTopK() = 0``, ``getTopP() = 0.0f``), and ``regularizeTopKTopP``
    (cpp/tensorrt_llm/kernels/samplingTopKKernels.h) turns ``topK == 0 && topP == 0.0f`` into
    ``topK = 1`` — greedy. So a request with temperature > 0, top_k 0 and top_p 1.0 must send
    ``top_p=1.0`` explicitly (checkTopP in executor/samplingConfig.cpp accepts (0, 1]), or it
    silently decodes greedily.

    Temperature 0 means greedy, expressed as ``top_k=1, top_p=1.0`` with the default temperature.

    A sampled request without a seed gets a fresh random one. Unset, the decoding layers seed
    every request's curand state with ``DefaultDecodingParams::getSeed() == 0``
    (cpp/tensorrt_llm/layers/defaultDecodingParams.h; NVIDIA's maintainers confirm it: "it will
    initialize the random table by random seed 0 every time, and generate same results"), so
    identical unseeded requests would return identical completions on GPU pools while the
    reference engine (and OpenAI's API) draw a new sample each time.
    """
    s = request.sampling
    kwargs: dict[str, Any] = {"beam_width": 1}
    if s.temperature == 0.0:
        kwargs["top_k"] = 1
        kwargs["top_p"] = 1.0
    else:
        kwargs["temperature"] = s.temperature
        kwargs["top_k"] = s.top_k  # 0 = no top-k cut (kept 0 by regularizeTopKTopP once top_p > 0)
        kwargs["top_p"] = s.top_p  # contract: within (0, 1]; 1.0 = no nucleus cut
    if s.seed is not None:
        kwargs["seed"] = s.seed
    elif s.temperature != 0.0:
        kwargs["seed"] = secrets.randbits(63)  # SamplingConfig's seed is a uint64 (RandomSeedType)
    kwargs.update(request_extensions.sampling_extension_kwargs(s))  # penalties, min_tokens
    return trtllm.SamplingConfig(**kwargs)


def build_request(trtllm: ModuleType, request: EngineRequest, *, default_end_id: int | None, salt_supported: bool,
                  bias_layout: BiasLayout | None = None, guided_supported: bool = False) -> Any:
    """The executor ``Request`` for a validated :class:`EngineRequest` (request.cpp ``Request`` init).

    Raises :class:`request_extensions.ExtensionUnsupportedError` for what this executor cannot do and
    :class:`engines.contract.ContractError` for combinations it cannot be sent safely.
    """
    end_id = request.end_id if request.end_id is not None else default_end_id
    kwargs: dict[str, Any] = {
        "input_token_ids": list(request.input_ids),
        "max_tokens": request.max_new_tokens,
        "streaming": request.streaming,
        "sampling_config": sampling_config(trtllm, request),
        # exclude_input_from_output: output_ids carry generated tokens only (the contract);
        # return_perf_metrics: per-request KvCacheMetrics (reused/new/total blocks).
        "output_config": trtllm.OutputConfig(exclude_input_from_output=True, return_perf_metrics=True,
                                             **request_extensions.output_config_kwargs(request)),
    }
    if end_id is not None:
        kwargs["end_id"] = end_id
    # ignore_eos (end_id -1), logit bias (embedding_bias), guide: engines/trtllm/request_extensions.py
    kwargs.update(request_extensions.request_extension_kwargs(
        trtllm, request, bias_layout=bias_layout, guided_supported=guided_supported))
    retention = retention_config(trtllm, request.retention)
    if retention is not None:
        kwargs["kv_cache_retention_config"] = retention
    if request.cache_salt is not None:
        if not salt_supported:
            raise SaltUnsupportedError(
                "this TensorRT-LLM build's executor Request has no cache_salt_id (PR #7106): "
                "a salted tenant cannot be isolated, so the request is refused"
            )
        kwargs["cache_salt_id"] = cache_salt_id(request.cache_salt)
    return trtllm.Request(**kwargs)
