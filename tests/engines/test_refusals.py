"""Each engine refusal is read back by the gateway's reader, whatever Triton prepends."""

import numpy as np
import pytest

from engines.contract import INPUT_IDS, REQUEST_OUTPUT_LEN, ContractError, parse_request
from engines.refusals import (
    context_refusal,
    guide_does_not_compile,
    guide_refusal,
    output_out_of_range,
    output_refusal,
    too_long,
)

LIMITS = {"max_output_len": 64, "max_input_len": 32, "vocab_size": 1000}


def _refusal(ids: int, out: int) -> str:
    tensors = {INPUT_IDS.name: np.zeros(ids, dtype=np.int32), REQUEST_OUTPUT_LEN.name: np.array([out], dtype=np.int32)}
    with pytest.raises(ContractError) as info:
        parse_request(tensors, **LIMITS)
    return f"[StatusCode.INVALID_ARGUMENT] [request id: 7] {info.value}"


def test_each_reader_reads_its_producer_and_nothing_else():
    assert context_refusal(f"x: {too_long(40, 32)}") == (40, 32)
    assert output_refusal(f"x: {output_out_of_range(64, 65)}") == (64, 65)
    assert output_refusal(output_out_of_range(64, -1)) == (64, -1)
    assert guide_refusal(guide_does_not_compile("json_schema", "bad ref")) == "bad ref"
    for message in (too_long(40, 32), output_out_of_range(64, 0), guide_does_not_compile("regex", "x")):
        readers = [context_refusal(message), output_refusal(message), guide_refusal(message)]
        assert sum(r is not None for r in readers) == 1, message


def test_the_contracts_own_refusals_are_read_back():
    assert context_refusal(_refusal(33, 4)) == (33, 32)
    assert output_refusal(_refusal(4, 65)) == (64, 65)
    assert output_refusal(_refusal(4, 0)) == (64, 0)


def test_tensorrt_llms_own_prompt_refusal_is_a_context_refusal():
    # LlmRequest::validate (cpp/tensorrt_llm/batch_manager/llmRequest.cpp), as the Triton model forwards it
    raw = ("[TensorRT-LLM][ERROR] Assertion failed: Prompt length (4000) exceeds maximum input length (2048). "
           "Set log level to info and check TRTGptModel logs for how maximum input length is set")
    assert context_refusal(raw) == (4000, 2048)
    assert context_refusal("Draft tokens length (9) exceeds maximum draft tokens length (8).") is None


def test_xgrammars_clock_and_source_position_are_dropped():
    raw = "[17:02:11.501] /project/cpp/json_schema_converter.cc:618: Unsupported keyword: foo"
    assert guide_refusal(f"[kvgate_llm] {guide_does_not_compile('json_schema', raw)}") == "Unsupported keyword: foo"
