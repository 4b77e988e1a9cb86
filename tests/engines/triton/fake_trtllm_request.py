"""What a request is made of in the ``fake_trtllm`` double: cpp/tensorrt_llm/nanobind/executor/request.cpp
(Request, SamplingConfig, OutputConfig, GuidedDecodingParams, KvCacheRetentionConfig and its
TokenRangeRetentionConfig).

Each constructor takes the binding's argument names, keyword-only markers and defaults; it refuses a
bad type with TypeError (nanobind), a value the C++ constructor checks with what nanobind makes of its
exception (``std::invalid_argument`` → ValueError, ``TLLM_CHECK`` → RuntimeError), stores what the
double reads later and appends one ``(class name, kwargs)`` entry to its module's ``calls``. Templates:
use them through a module (``fake_trtllm_bound``).
"""

from __future__ import annotations

import enum

from tests.engines.triton.fake_trtllm_bound import Bound
from tests.engines.triton.fake_trtllm_checks import NONE, check_bool, check_duration, check_float, check_int
from tests.engines.triton.fake_trtllm_sampling import DEFAULT_TOP_K, DEFAULT_TOP_P, regularize_top_k_top_p


class TokenRangeRetentionConfig(Bound):
    def __init__(self, token_start, token_end, priority, duration_ms=None):
        # SizeType32 / std::optional<SizeType32>: any int32 converts; the range rules are checked
        # by KvCacheRetentionConfig (below), the priority here. None is refused: NVIDIA/TensorRT-LLM
        # ac456dca cpp/tensorrt_llm/nanobind/executor/request.cpp declares nb::arg("token_end") without
        # .none(), and nanobind then refuses None even for a std::optional (TypeError) — an open end
        # cannot be sent through the 1.2-era binding; kvgate sends SizeType32 max instead.
        check_int("token_start", token_start, lo=-(2**31), hi=2**31 - 1)
        check_int("token_end", token_end, lo=-(2**31), hi=2**31 - 1)
        check_int("priority", priority, lo=-(2**31), hi=2**31 - 1)  # RetentionPriority = SizeType32
        # kvCacheRetentionConfig.cpp TokenRangeRetentionConfig ctor: TLLM_CHECK_WITH_INFO(priority in
        # [kMinRetentionPriority, kMaxRetentionPriority]) -> TllmException -> RuntimeError.
        if not 0 <= priority <= 100:
            raise RuntimeError("Invalid priority value. Must be between 0 and 100")
        check_duration("duration_ms", duration_ms)
        self.token_start, self.token_end, self.priority, self.duration_ms = token_start, token_end, priority, duration_ms
        self._bindings.calls.append(("TokenRangeRetentionConfig", dict(token_start=token_start, token_end=token_end,
                                                                       priority=priority, duration_ms=duration_ms)))


class KvCacheRetentionConfig(Bound):
    def __init__(self, token_range_retention_configs, decode_retention_priority=35, decode_duration_ms=None,
                 transfer_mode=None, directory=None):
        # ac456dca request.cpp: `directory` is a plain std::string whose nb::arg default is nb::none(), so
        # omitting it (or passing None) is a TypeError; kvgate passes "" (executor.h's C++ default).
        if not isinstance(directory, str):
            raise TypeError(f"directory: expected str (std::string, no default usable), got {type(directory).__name__}")
        if not isinstance(token_range_retention_configs, list) or not all(
            isinstance(r, self._bindings.TokenRangeRetentionConfig) for r in token_range_retention_configs
        ):
            raise TypeError("token_range_retention_configs: expected list[TokenRangeRetentionConfig]")
        # RetentionPriority = SizeType32, and neither the binding (request.cpp: a plain nb::init) nor the
        # C++ constructor (kvCacheRetentionConfig.cpp, 3585984b) range-checks the decode priority: 101 is
        # accepted here (kvgate checks it itself: executor_args.retention_config).
        check_int("decode_retention_priority", decode_retention_priority, lo=-(2**31), hi=2**31 - 1)
        check_duration("decode_duration_ms", decode_duration_ms)
        # cpp/tensorrt_llm/executor/kvCacheRetentionConfig.cpp (KvCacheRetentionConfig ctor, NVIDIA/
        # TensorRT-LLM fbbc05dd): ranges sorted by start, then each throws std::invalid_argument
        # (nanobind: ValueError) in this order.
        # The "Invalid use of end indicator." check (an open end not last) cannot be reached: no end is None here.
        ordered = sorted(token_range_retention_configs, key=lambda r: r.token_start)
        for i, r in enumerate(ordered):
            if r.token_start < 0:
                raise ValueError("Token indices must be non-negative.")
            if r.token_start >= r.token_end:
                raise ValueError("Range must have a positive, non-zero length.")
            if i != len(ordered) - 1 and r.token_end > ordered[i + 1].token_start:
                raise ValueError("Token ranges must be non-overlapping.")
        self.token_range_retention_configs = token_range_retention_configs
        self.decode_retention_priority = decode_retention_priority
        self.decode_duration_ms = decode_duration_ms
        self.directory = directory
        self._bindings.calls.append(("KvCacheRetentionConfig", dict(decode_retention_priority=decode_retention_priority,
                                                                    decode_duration_ms=decode_duration_ms,
                                                                    directory=directory)))


class SamplingConfig(Bound):
    """``effective_top_k`` / ``effective_top_p``: what the decoding layers run (unset fields take
    DefaultDecodingParams, then regularizeTopKTopP); ``greedy`` is ``effective_top_k == 1``."""

    def __init__(self, beam_width=1, *, top_k=None, top_p=None, top_p_min=None, top_p_reset_ids=None, top_p_decay=None,
                 seed=None, temperature=None, min_tokens=None, beam_search_diversity_rate=None, repetition_penalty=None,
                 presence_penalty=None, frequency_penalty=None, length_penalty=None, early_stopping=None,
                 no_repeat_ngram_size=None, num_return_sequences=None, min_p=None, beam_width_array=None):
        check_int("beam_width", beam_width, lo=1)
        check_int("top_k", top_k, optional=True)
        check_float("top_p", top_p, optional=True)
        check_float("temperature", temperature, optional=True)
        check_int("seed", seed, optional=True, lo=0, hi=2**64 - 1)
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
        check_float("repetition_penalty", repetition_penalty, optional=True)
        check_float("presence_penalty", presence_penalty, optional=True)
        check_float("frequency_penalty", frequency_penalty, optional=True)
        check_int("min_tokens", min_tokens, optional=True, lo=-(2**31), hi=2**31 - 1)  # OptSize32
        if repetition_penalty is not None and not repetition_penalty > 0.0:
            raise RuntimeError("Repetition penalty should be strictly greater than zero.")
        if min_tokens is not None and min_tokens < 0:
            raise RuntimeError("min_tokens must be >= 0")
        self.repetition_penalty, self.presence_penalty = repetition_penalty, presence_penalty
        self.frequency_penalty, self.min_tokens = frequency_penalty, min_tokens
        self.beam_width, self.top_k, self.top_p, self.temperature, self.seed = beam_width, top_k, top_p, temperature, seed
        # What the decoding layers run: unset fields take DefaultDecodingParams, then regularizeTopKTopP.
        self.effective_top_k, self.effective_top_p = regularize_top_k_top_p(
            DEFAULT_TOP_K if top_k is None else top_k, DEFAULT_TOP_P if top_p is None else float(top_p))
        self.greedy = self.effective_top_k == 1
        self._bindings.calls.append(("SamplingConfig", dict(
            beam_width=beam_width, top_k=top_k, top_p=top_p, temperature=temperature, seed=seed,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, min_tokens=min_tokens)))


class OutputConfig(Bound):
    def __init__(self, return_log_probs=False, return_context_logits=False, return_generation_logits=False,
                 exclude_input_from_output=False, return_encoder_output=False, return_perf_metrics=False,
                 additional_model_outputs=None):
        for name, value in (("exclude_input_from_output", exclude_input_from_output), ("return_perf_metrics", return_perf_metrics)):
            check_bool(name, value)
        check_bool("return_log_probs", return_log_probs)  # request.cpp OutputConfig: bool
        self.return_log_probs = return_log_probs
        self.exclude_input_from_output = exclude_input_from_output
        self.return_perf_metrics = return_perf_metrics
        self._bindings.calls.append(("OutputConfig", dict(exclude_input_from_output=exclude_input_from_output,
                                                          return_perf_metrics=return_perf_metrics,
                                                          return_log_probs=return_log_probs)))


class GuideType(enum.Enum):  # request.cpp: GuidedDecodingParams.GuideType
    JSON = 0
    JSON_SCHEMA = 1
    REGEX = 2
    EBNF_GRAMMAR = 3
    STRUCTURAL_TAG = 4


class GuidedDecodingParams(Bound):
    # request.cpp: nb::init<GuideType, std::optional<std::string>>(), guide_type, guide=None
    def __init__(self, guide_type, guide=None):
        if not isinstance(guide_type, self._bindings.GuideType):
            raise TypeError("guide_type: expected GuidedDecodingParams.GuideType")
        if guide is not None and not isinstance(guide, str):
            raise TypeError("guide: expected str or None")
        self.guide_type, self.guide = guide_type, guide
        self._bindings.calls.append(("GuidedDecodingParams", dict(guide_type=guide_type, guide=guide)))


class Request(Bound):
    """A Request of a binding that takes ``cache_salt_id``. An omitted ``sampling_config`` is
    None (every field unset: greedy); an omitted ``output_config`` is a default OutputConfig, constructed
    (and logged in ``calls``) before the Request itself is."""

    def __init__(self, input_token_ids, max_tokens, *, streaming=False, sampling_config=NONE, output_config=NONE,
                 end_id=None, pad_id=None, position_ids=None, bad_words=None, stop_words=None, embedding_bias=None,
                 external_draft_tokens_config=None, prompt_tuning_config=None, multimodal_input=None,
                 multimodal_embedding=None, mrope_config=None, lora_config=None, lookahead_config=None,
                 kv_cache_retention_config=None, logits_post_processor_name=None, logits_post_processor=None,
                 encoder_input_token_ids=None, client_id=None, return_all_generated_tokens=False, priority=0.5,
                 type=None, context_phase_params=None, encoder_input_features=None, encoder_output_length=None,
                 cross_attention_mask=None, num_return_sequences=1, eagle_config=None, skip_cross_attn_blocks=None,
                 guided_decoding_params=None, language_adapter_uid=None, allotted_time_ms=None, cache_salt_id=None):
        bindings = self._bindings
        if not isinstance(input_token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_token_ids):
            raise TypeError("input_token_ids: expected list[int] (VecTokens)")
        check_int("max_tokens", max_tokens, lo=1)
        check_bool("streaming", streaming)
        # std::optional<SizeType32>: any int32; the LLM API sends -1 for ignore_eos (executor/base_worker.py)
        check_int("end_id", end_id, optional=True, lo=-(2**31), hi=2**31 - 1)
        if sampling_config is not NONE and not isinstance(sampling_config, bindings.SamplingConfig):
            raise TypeError("sampling_config: expected SamplingConfig")
        if output_config is not NONE and not isinstance(output_config, bindings.OutputConfig):
            raise TypeError("output_config: expected OutputConfig")
        if kv_cache_retention_config is not None and not isinstance(kv_cache_retention_config, bindings.KvCacheRetentionConfig):
            raise TypeError("kv_cache_retention_config: expected KvCacheRetentionConfig")
        check_int("cache_salt_id", cache_salt_id, optional=True, lo=0, hi=2**64 - 1)  # CacheSaltIDType = std::uint64_t
        # request.cpp: embedding_bias std::optional<Tensor> (a torch tensor from Python),
        # guided_decoding_params std::optional<GuidedDecodingParams>.
        if embedding_bias is not None:
            import torch

            if not isinstance(embedding_bias, torch.Tensor):
                raise TypeError("embedding_bias: expected a Tensor")
        if guided_decoding_params is not None and not isinstance(guided_decoding_params, bindings.GuidedDecodingParams):
            raise TypeError("guided_decoding_params: expected GuidedDecodingParams")
        self.embedding_bias = embedding_bias
        self.guided_decoding_params = guided_decoding_params
        self.input_token_ids = input_token_ids
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.sampling_config = None if sampling_config is NONE else sampling_config
        self.output_config = bindings.OutputConfig() if output_config is NONE else output_config
        self.end_id = end_id
        self.kv_cache_retention_config = kv_cache_retention_config
        self.cache_salt_id = cache_salt_id
        bindings.calls.append(("Request", dict(input_token_ids=input_token_ids, max_tokens=max_tokens, streaming=streaming,
                                               end_id=end_id, cache_salt_id=cache_salt_id)))


class RequestWithoutSalt(Request):
    """A Request of a binding older than ``cache_salt_id``: passing it is nanobind's TypeError."""

    def __init__(self, input_token_ids, max_tokens, **kwargs):
        if "cache_salt_id" in kwargs:
            raise TypeError("__init__(): incompatible function arguments")  # what nanobind says
        super().__init__(input_token_ids, max_tokens, **kwargs)
