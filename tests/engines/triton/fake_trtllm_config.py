"""Executor configuration of the ``fake_trtllm`` double: cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp
(KvCacheConfig, ExecutorConfig, ParallelConfig, OrchestratorConfig, GuidedDecodingConfig) and the ModelType /
CommunicationMode enums (bindings.cpp).

Each constructor takes the binding's argument names, keyword-only markers and defaults, refuses anything
else with TypeError (``fake_trtllm_checks``), stores what it was given and appends one
``(class name, kwargs)`` entry to its module's ``calls``. Templates: use them through a module
(``fake_trtllm_bound``).
"""

from __future__ import annotations

import enum

from tests.engines.triton.fake_trtllm_bound import Bound
from tests.engines.triton.fake_trtllm_checks import NONE, check_bool, check_float, check_int


class ModelType(enum.Enum):
    DECODER_ONLY = 0
    ENCODER_ONLY = 1
    ENCODER_DECODER = 2


class CommunicationMode(enum.Enum):
    LEADER = 0
    ORCHESTRATOR = 1


class GuidedDecodingBackend(enum.Enum):  # executorConfig.cpp: GuidedDecodingConfig.GuidedDecodingBackend
    XGRAMMAR = 0
    LLGUIDANCE = 1


class KvCacheConfig(Bound):
    """Every argument is an attribute; instances also carry their module's ``calls`` (as they always have)."""

    # executorConfig.cpp, newest snapshot before PR #12449 (which removed onboard_blocks on
    # main, 2026-03-23): ten positional-or-keyword arguments, then keyword-only ones.
    def __init__(self, enable_block_reuse=True, max_tokens=None, max_attention_window=None, sink_token_length=None,
                 free_gpu_memory_fraction=None, host_cache_size=None, onboard_blocks=True, cross_kv_cache_fraction=None,
                 secondary_offload_min_priority=None, event_buffer_max_size=0, *, enable_partial_reuse=True,
                 copy_on_partial_reuse=True, use_uvm=False, attention_dp_events_gather_period_ms=5,
                 runtime_defaults=None, max_gpu_total_bytes=0):
        arguments = {k: v for k, v in locals().items() if k != "self"}
        check_bool("enable_block_reuse", enable_block_reuse)
        check_int("max_tokens", max_tokens, optional=True, lo=1)
        check_float("free_gpu_memory_fraction", free_gpu_memory_fraction, optional=True)
        if free_gpu_memory_fraction is not None and not 0.0 < free_gpu_memory_fraction < 1.0:
            # KvCacheConfig::setFreeGpuMemoryFraction (executor/kvCacheConfig.cpp): TLLM_CHECK(> 0), (< 1)
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: freeGpuMemoryFraction < 1.F "
                               f"(got {free_gpu_memory_fraction})")
        check_int("host_cache_size", host_cache_size, optional=True, lo=0)  # std::optional<size_t>
        check_bool("onboard_blocks", onboard_blocks)
        check_int("secondary_offload_min_priority", secondary_offload_min_priority, optional=True, lo=0, hi=100)
        check_int("event_buffer_max_size", event_buffer_max_size, lo=0)  # size_t
        check_bool("enable_partial_reuse", enable_partial_reuse)
        check_bool("copy_on_partial_reuse", copy_on_partial_reuse)
        self.__dict__.update(arguments)
        self.calls = self._bindings.calls
        self._bindings.calls.append(("KvCacheConfig", dict(arguments)))


EXECUTOR_CONFIG_ARGS = {
    "max_beam_width", "scheduler_config", "kv_cache_config", "enable_chunked_context", "normalize_log_probs",
    "iter_stats_max_iterations", "request_stats_max_iterations", "batching_type", "max_batch_size", "max_num_tokens",
    "parallel_config", "peft_cache_config", "logits_post_processor_config", "decoding_config", "use_gpu_direct_storage",
    "gpu_weights_percent", "max_queue_size", "extended_runtime_perf_knob_config", "debug_config", "recv_poll_period_ms",
    "max_seq_idle_microseconds", "spec_dec_config", "guided_decoding_config", "additional_model_outputs",
    "cache_transceiver_config", "gather_generation_logits", "mm_embedding_offloading", "enable_trt_overlap",
    "fail_fast_on_attention_window_too_large",
}


class ExecutorConfig(Bound):
    """Only the arguments given become attributes (the executor reads the rest with their defaults)."""

    def __init__(self, **kwargs):
        bindings = self._bindings
        unknown = set(kwargs) - EXECUTOR_CONFIG_ARGS
        if unknown:
            raise TypeError(f"ExecutorConfig: unexpected keyword(s) {sorted(unknown)}")
        check_int("max_beam_width", kwargs.get("max_beam_width", 1), lo=1)
        if "kv_cache_config" in kwargs and not isinstance(kwargs["kv_cache_config"], bindings.KvCacheConfig):
            raise TypeError("kv_cache_config: expected KvCacheConfig")
        if "parallel_config" in kwargs and not isinstance(kwargs["parallel_config"], bindings.ParallelConfig):
            raise TypeError("parallel_config: expected ParallelConfig")
        if kwargs.get("guided_decoding_config") is not None and not isinstance(kwargs["guided_decoding_config"],
                                                                              bindings.GuidedDecodingConfig):
            raise TypeError("guided_decoding_config: expected GuidedDecodingConfig")
        for key in ("max_batch_size", "max_num_tokens", "max_queue_size"):
            check_int(key, kwargs.get(key), optional=True, lo=1)
        check_int("iter_stats_max_iterations", kwargs.get("iter_stats_max_iterations", 1000), lo=0)
        check_bool("normalize_log_probs", kwargs.get("normalize_log_probs", True))
        self.__dict__.update(kwargs)
        bindings.calls.append(("ExecutorConfig", dict(kwargs)))


class OrchestratorConfig(Bound):
    def __init__(self, is_orchestrator=True, worker_executable_path="", orch_leader_comm=None, spawn_processes=True):
        check_bool("is_orchestrator", is_orchestrator)
        if not isinstance(worker_executable_path, str):
            raise TypeError("worker_executable_path: expected str")
        self.is_orchestrator, self.worker_executable_path = is_orchestrator, worker_executable_path
        self._bindings.calls.append(("OrchestratorConfig", dict(is_orchestrator=is_orchestrator,
                                                                worker_executable_path=worker_executable_path)))


class ParallelConfig(Bound):
    """``communication_mode`` defaults to the module's ``CommunicationMode.LEADER``."""

    def __init__(self, communication_type=None, communication_mode=NONE, device_ids=None,
                 participant_ids=None, orchestrator_config=None, num_nodes=None):
        bindings = self._bindings
        if communication_mode is NONE:
            communication_mode = bindings.CommunicationMode.LEADER
        if not isinstance(communication_mode, bindings.CommunicationMode):
            raise TypeError("communication_mode: expected CommunicationMode")
        if orchestrator_config is not None and not isinstance(orchestrator_config, bindings.OrchestratorConfig):
            raise TypeError("orchestrator_config: expected OrchestratorConfig")
        self.communication_mode, self.orchestrator_config = communication_mode, orchestrator_config
        bindings.calls.append(("ParallelConfig", dict(communication_mode=communication_mode,
                                                      orchestrator_config=orchestrator_config)))


class GuidedDecodingConfig(Bound):
    # executorConfig.cpp: nb::init<GuidedDecodingBackend, optional<vector<string>>, optional<string>,
    # optional<vector<TokenIdType>>>(), backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None
    def __init__(self, backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None):
        if not isinstance(backend, self._bindings.GuidedDecodingBackend):
            raise TypeError("backend: expected GuidedDecodingConfig.GuidedDecodingBackend")
        if encoded_vocab is not None and not (isinstance(encoded_vocab, list) and all(isinstance(t, str) for t in encoded_vocab)):
            raise TypeError("encoded_vocab: expected list[str]")
        if tokenizer_str is not None and not isinstance(tokenizer_str, str):
            raise TypeError("tokenizer_str: expected str")
        if stop_token_ids is not None and not (isinstance(stop_token_ids, list) and all(isinstance(t, int) for t in stop_token_ids)):
            raise TypeError("stop_token_ids: expected list[int]")
        self.backend, self.encoded_vocab = backend, encoded_vocab
        self.tokenizer_str, self.stop_token_ids = tokenizer_str, stop_token_ids
        self._bindings.calls.append(("GuidedDecodingConfig", dict(backend=backend, vocab_size=len(encoded_vocab or []),
                                                                  stop_token_ids=stop_token_ids)))
