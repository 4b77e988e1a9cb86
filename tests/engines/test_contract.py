"""The engine-model contract round-trips and refuses bad requests with the tensor named."""

from __future__ import annotations

import numpy as np
import pytest

from engines.contract import (
    ContractError,
    EngineRequest,
    SamplingParams,
    encode_request,
    parse_request,
)
from retention.types import RetentionPlan, TokenRange

LIMITS = dict(max_output_len=64, max_input_len=512, vocab_size=1000)


def _request(**changes) -> EngineRequest:
    plan = RetentionPlan((TokenRange(0, 8, 90, None), TokenRange(8, None, 20, 30_000)), 10, 5_000)
    base = dict(
        input_ids=tuple(range(1, 21)), max_new_tokens=16, end_id=2, streaming=True,
        sampling=SamplingParams(0.5, 0.75, 40, 7), retention=plan, cache_salt="s", tenant_id="t",
    )
    base.update(changes)
    return EngineRequest(**base)


def test_round_trip_including_open_ended_range_and_durations() -> None:
    request = _request()
    assert parse_request(encode_request(request), **LIMITS) == request


def test_leading_batch_dimension_is_accepted() -> None:
    tensors = {k: v[None, ...] for k, v in encode_request(_request()).items()}
    assert parse_request(tensors, **LIMITS) == _request()


@pytest.mark.parametrize(
    ("mutate", "tensor"),
    [
        (lambda t: t.update(retention_token_range_ends=np.array([8], np.int32)), "retention_token_range_ends"),
        (lambda t: t.update(retention_token_range_priorities=np.array([101, 20], np.int32)), "retention_token_range_priorities"),
        (lambda t: t.update(retention_decode_priority=np.array([-1], np.int32)), "retention_decode_priority"),
        (lambda t: t.update(input_ids=np.array([], np.int32)), "input_ids"),
        (lambda t: t.update(input_ids=np.array([5, 1000], np.int32)), "input_ids"),
        (lambda t: t.update(request_output_len=np.array([65], np.int32)), "request_output_len"),
        (lambda t: t.pop("request_output_len"), "request_output_len"),
        (lambda t: t.update(runtime_top_p=np.array([0.0], np.float32)), "runtime_top_p"),
        (lambda t: t.update(retention_token_range_starts=np.array([0, 4], np.int32)), "retention_token_range_starts"),
    ],
)
def test_bad_requests_name_the_tensor(mutate, tensor) -> None:
    tensors = encode_request(_request())
    mutate(tensors)
    with pytest.raises(ContractError) as info:
        parse_request(tensors, **LIMITS)
    assert info.value.tensor == tensor


# Sampling extensions, log probabilities, logit bias, guides ----------------------------
from engines.contract import (  # noqa: E402
    Guide,
    KvMetrics,
    TokenLogProbs,
)
from engines.response_tensors import decode_log_probs, encode_response  # noqa: E402


def test_a_prompt_over_the_input_limit_is_refused_in_words_the_gateway_reads() -> None:
    from engines.refusals import context_refusal

    tensors = encode_request(_request())
    tensors["input_ids"] = np.ones(LIMITS["max_input_len"] + 1, np.int32)
    with pytest.raises(ContractError) as info:
        parse_request(tensors, **LIMITS)
    # as an engine passes it on: prefixed by its model or tensor name
    assert context_refusal(f"[kvgate_llm] {info.value}") == (LIMITS["max_input_len"] + 1, LIMITS["max_input_len"])
    assert context_refusal("input_ids must be token ids in [0, 1000)") is None


def test_extensions_round_trip() -> None:
    sampling = SamplingParams(0.5, 0.75, 5, 3, repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=1.5,
                              min_tokens=4, logit_bias=((7, 5.0), (9, -100.0)))
    request = _request(sampling=sampling, ignore_eos=True, return_log_probs=True, num_top_log_probs=3)
    assert parse_request(encode_request(request), **LIMITS) == request
    guided = _request(sampling=sampling, return_log_probs=True, guide=Guide("json_schema", '{"type": "object"}'))
    assert parse_request(encode_request(guided), **LIMITS) == guided
    assert parse_request(encode_request(_request(guide=Guide("json"))), **LIMITS).guide == Guide("json")


def test_defaults_send_no_extension_tensors() -> None:
    names = set(encode_request(_request()))
    assert not names & {"repetition_penalty", "min_tokens", "ignore_eos", "return_log_probs", "guided_decoding_guide_type",
                        "logit_bias_token_ids"}


@pytest.mark.parametrize(
    ("changes", "tensor"),
    [
        ({"repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty"),
        ({"presence_penalty": np.array([2.5], np.float32)}, "presence_penalty"),
        ({"frequency_penalty": np.array([np.nan], np.float32)}, "frequency_penalty"),
        ({"min_tokens": np.array([17], np.int32)}, "min_tokens"),  # > request_output_len 16
        ({"num_top_log_probs": np.array([2], np.int32)}, "num_top_log_probs"),  # without return_log_probs
        ({"return_log_probs": np.array([True]), "num_top_log_probs": np.array([21], np.int32)}, "num_top_log_probs"),
        ({"logit_bias_token_ids": np.array([1], np.int32)}, "logit_bias_token_ids"),
        ({"logit_bias_token_ids": np.array([1, 2], np.int32), "logit_bias_values": np.array([1.0], np.float32)},
         "logit_bias_values"),
        ({"logit_bias_token_ids": np.array([1000], np.int32), "logit_bias_values": np.array([1.0], np.float32)},
         "logit_bias_token_ids"),
        ({"logit_bias_token_ids": np.array([1, 1], np.int32), "logit_bias_values": np.array([1.0, 2.0], np.float32)},
         "logit_bias_token_ids"),
        ({"guided_decoding_guide_type": np.array([b"xml"], np.object_)}, "guided_decoding_guide_type"),
        ({"guided_decoding_guide_type": np.array([b"regex"], np.object_)}, "guided_decoding_guide"),
        ({"guided_decoding_guide": np.array([b"[0-9]+"], np.object_)}, "guided_decoding_guide_type"),
        ({"guided_decoding_guide_type": np.array([b"json_schema"], np.object_),
          "guided_decoding_guide": np.array([b"{not json"], np.object_)}, "guided_decoding_guide"),
        ({"guided_decoding_guide_type": np.array([b"json_schema"], np.object_),
          "guided_decoding_guide": np.array([(b'{"a":' * 100 + b"1" + b"}" * 100)], np.object_)}, "guided_decoding_guide"),
    ],
)
def test_bad_extensions_name_their_tensor(changes, tensor) -> None:
    tensors = encode_request(_request())
    tensors.update(changes)
    with pytest.raises(ContractError) as caught:
        parse_request(tensors, **LIMITS)
    assert caught.value.tensor == tensor


def test_log_probs_round_trip_through_the_response_tensors() -> None:
    probs = (TokenLogProbs(-0.5, ((3, -0.5), (4, -1.5))), TokenLogProbs(-2.0, ((5, -0.125), (6, -2.0))))
    out = encode_response([3, 6], 2, KvMetrics(), probs, num_top=2)
    assert out["top_log_probs"].shape == (2, 2) and out["top_log_probs_token_ids"].dtype == np.int32
    assert decode_log_probs(out) == probs
    assert decode_log_probs(encode_response([3], 1, KvMetrics())) is None


def test_cached_prompt_tokens_never_count_the_last_prompt_token() -> None:
    from engines.contract import cached_prompt_tokens

    assert cached_prompt_tokens(4, 79, 16) == 64  # whole blocks
    # TensorRT-LLM's partial reuse counts a block matched in part as reused: five blocks for 78 tokens
    assert cached_prompt_tokens(5, 79, 16) == 78
    assert cached_prompt_tokens(2, 32, 16) == 31  # the last prompt token is always computed
    assert cached_prompt_tokens(0, 10, 16) == cached_prompt_tokens(3, 1, 16) == 0


def test_a_top_p_below_float32s_range_still_reaches_the_engine_as_a_nucleus() -> None:
    from engines.contract import EngineRequest, SamplingParams, encode_request, parse_request
    from retention.types import RetentionPlan

    request = EngineRequest(input_ids=(1, 2, 3), max_new_tokens=2, end_id=None, streaming=False,
                            sampling=SamplingParams(top_p=1e-300), retention=RetentionPlan(), cache_salt=None,
                            tenant_id=None)
    parsed = parse_request(encode_request(request), max_output_len=8, max_input_len=8, vocab_size=16)
    assert 0.0 < parsed.sampling.top_p < 1e-30


@pytest.mark.parametrize("end_id", [1000, 5000, 2**31 - 1])
def test_an_end_id_outside_the_vocabulary_is_refused_naming_end_id(end_id) -> None:
    """An out-of-vocabulary end id would index past the logits row (the min-length mask) or make
    xgrammar raise (a guide's stop token): refused up front on every engine."""
    tensors = encode_request(_request())
    tensors["end_id"] = np.array([end_id], np.int32)
    with pytest.raises(ContractError) as caught:
        parse_request(tensors, **LIMITS)
    assert caught.value.tensor == "end_id"


def test_end_ids_inside_the_vocabulary_or_none_are_taken() -> None:
    for end_id, expected in ((999, 999), (0, 0), (-1, None)):
        tensors = encode_request(_request())
        tensors["end_id"] = np.array([end_id], np.int32)
        assert parse_request(tensors, **LIMITS).end_id == expected


def test_top_k_is_clamped_to_tensorrt_llms_top_k_max() -> None:
    """TensorRT-LLM clamps a runtime top-k above TOP_K_MAX (1024, samplingTopKKernels.h) to it
    (clampTopK); the contract does the same so both engines cut at the same k."""
    from engines.contract import TOP_K_MAX

    assert TOP_K_MAX == 1024
    limits = dict(LIMITS, vocab_size=49152)
    for asked, expected in ((40, 40), (1024, 1024), (1025, 1024), (5000, 1024), (49152, 1024), (2**31 - 1, 1024), (0, 0)):
        tensors = encode_request(_request())
        tensors["runtime_top_k"] = np.array([asked], np.int32)
        assert parse_request(tensors, **limits).sampling.top_k == expected, asked
    # A vocabulary smaller than the cut: a cut at or above it is no cut.
    tensors = encode_request(_request())
    tensors["runtime_top_k"] = np.array([5000], np.int32)
    assert parse_request(tensors, **LIMITS).sampling.top_k == 0
