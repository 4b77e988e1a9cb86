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
