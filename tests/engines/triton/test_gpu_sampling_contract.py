"""The GPU path's sampling contract against the stricter executor double.

Each test fails on an engine that sends what the 1.2 executor mishandles: normalised log
probabilities, an FP32 1-D ``embedding_bias``, no ``tokenizer_dir``, ``ignore_eos`` with
``min_tokens`` or with a guide, and unchecked retention values. Sources are cited in
tests/engines/triton/fake_trtllm.py next to each rule of the double.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import numpy as np
import pytest

import engines.response_tensors as response_tensors
from engines.contract import ContractError, EngineRequest, Guide, SamplingParams, encode_request, parse_request
from engines.spec import load_bundled_spec
from engines.trtllm.executor_args import retention_config
from retention.types import RetentionPlan, TokenRange
from tests.engines.triton.conftest import make_harness
from tests.engines.triton.test_model import PROMPT, error_of, outputs, recorded_request


def request(**changes) -> dict[str, np.ndarray]:
    base = dict(input_ids=PROMPT[:5], max_new_tokens=4, end_id=None, streaming=False, sampling=SamplingParams(),
                retention=RetentionPlan(), cache_salt=None, tenant_id=None)
    base.update(changes)
    return encode_request(EngineRequest(**base))


def test_greedy_log_probs_are_not_renormalised_to_zero(harness):
    """ExecutorConfig.normalize_log_probs defaults to true in 1.2: a greedy token would report 0.0."""
    [(answer, _)] = outputs(harness.send(request(return_log_probs=True)))
    values = answer[response_tensors.OUTPUT_LOG_PROBS.name].tolist()
    tokens = answer[response_tensors.OUTPUT_IDS.name].tolist()
    assert len(values) == len(tokens) == 4
    assert values == pytest.approx([-0.5 - 0.01 * t for t in tokens])  # the double's simulated model, not 0.0
    assert harness.executor.config.normalize_log_probs is False


@pytest.mark.parametrize("logits_dtype, torch_dtype", [("float32", "torch.float32"), ("float16", "torch.float16"),
                                                        (None, "torch.float32")])
def test_embedding_bias_has_the_engines_logits_dtype_and_shape(tmp_path, monkeypatch, logits_dtype, torch_dtype):
    h = make_harness(tmp_path, monkeypatch, engine={"logits_dtype": logits_dtype})
    try:
        [(answer, _)] = outputs(h.send(request(sampling=SamplingParams(logit_bias=((5, 2.0), (9, -100.0))))))
        assert answer[response_tensors.OUTPUT_IDS.name].size == 4
        bias = recorded_request(h).embedding_bias
        assert tuple(bias.shape) == (1, 128256) and str(bias.dtype) == torch_dtype
        assert h.executor.warnings == []  # no float -> half conversion on the executor's side
    finally:
        h.model.finalize()


def test_the_double_throws_for_a_bias_the_executor_would_refuse(harness):
    """createNewDecoderRequests.cpp: a 1-D FP32 bias (what kvgate used to send) fails the shape check."""
    import torch

    trt = harness.trt
    for bias, fragment in ((torch.zeros(128256), "nbDims == 2"),
                           (torch.zeros((1, 128256), dtype=torch.bfloat16), "Embedding bias data type must be same"),
                           (torch.zeros((1, 1000)), "Expected last dimension to be same as vocab size: 128256")):
        rid = harness.executor.enqueue_request(trt.Request([1, 2, 3], 2, embedding_bias=bias))
        [response] = [r for r in harness.executor.await_responses() if r.request_id == rid]
        assert response.has_error() and fragment in response.error_msg


def test_a_bias_on_an_engine_with_a_padded_vocabulary_is_refused_by_name(tmp_path, monkeypatch):
    spec = load_bundled_spec("llama-3.1-70b-instruct-fp8-tp8")
    spec = spec.model_copy(update={"triton": spec.triton.model_copy(update={"vocab_size": 128257})})
    h = make_harness(tmp_path, monkeypatch, spec=spec)  # 128257 rounds up to 128264 over 8 ranks
    try:
        message = error_of(h.send(request(sampling=SamplingParams(logit_bias=((5, 2.0),)))))
        assert "logit_bias_token_ids" in message and "128264" in message
        assert len(h.executor.requests) == 0
        outputs(h.send(request()))  # requests without a bias are served
    finally:
        h.model.finalize()


def test_an_engine_with_another_vocabulary_does_not_start(tmp_path, monkeypatch):
    with pytest.raises(Exception, match="vocab_size 32000"):
        make_harness(tmp_path, monkeypatch, engine={"vocab_size": 32000})


def test_a_rendered_repository_enables_guided_decoding(tmp_path, monkeypatch):
    """The rendered tokenizer_dir (the engine builder's /engines/tokenizers/<spec>) builds GuidedDecodingConfig."""
    h = make_harness(tmp_path, monkeypatch)  # no operator parameters: only what the renderer wrote
    try:
        assert h.params["parameters"]["tokenizer_dir"]["string_value"].endswith("/tokenizers/llama-3.1-8b-instruct-fp8kv")
        assert h.model.guided_supported and h.executor.config.guided_decoding_config is not None
        outputs(h.send(request(guide=Guide("json_schema", '{"type": "object"}'))))
        assert recorded_request(h).guided_decoding_params.guide_type is h.trt.GuidedDecodingParams.GuideType.JSON_SCHEMA
    finally:
        h.model.finalize()


def test_a_rendered_tokenizer_dir_without_a_tokenizer_stops_the_model(tmp_path, monkeypatch):
    with pytest.raises(Exception, match="tokenizer.json"):
        make_harness(tmp_path, monkeypatch, tokenizer=False)


def test_ignore_eos_with_min_tokens_is_refused_naming_both(harness):
    """penaltyKernels.cu writes logits[endIds[slot]] unguarded; ignore_eos is end id -1."""
    message = error_of(harness.send(request(ignore_eos=True, sampling=SamplingParams(min_tokens=2))))
    assert "ignore_eos" in message and "min_tokens" in message and "engine error" not in message
    assert len(harness.executor.requests) == 0
    outputs(harness.send(request(ignore_eos=True)))  # each alone is fine
    outputs(harness.send(request(sampling=SamplingParams(min_tokens=2))))


def test_ignore_eos_with_a_guide_is_refused_naming_both_on_both_engines(harness):
    tensors = request(ignore_eos=True, guide=Guide("json"))
    message = error_of(harness.send(tensors))
    assert "ignore_eos" in message and "guided_decoding_guide_type" in message
    assert len(harness.executor.requests) == 0
    # The reference engine parses with the same function (engines/reference/kserve.py).
    with pytest.raises(ContractError) as caught:
        parse_request(tensors, max_output_len=64, max_input_len=64, vocab_size=128256)
    assert caught.value.tensor == "ignore_eos"


def test_retention_errors_have_the_bindings_types_and_kvgate_checks_the_rest(harness):
    trt = harness.trt
    token_range = trt.KvCacheRetentionConfig.TokenRangeRetentionConfig
    with pytest.raises(RuntimeError, match="Invalid priority value. Must be between 0 and 100"):
        token_range(0, 10, 101)
    with pytest.raises(RuntimeError):
        token_range(0, 10, -1)
    for ranges, message in (([token_range(-4, 10, 50)], "Token indices must be non-negative."),
                            ([token_range(8, 8, 50)], "Range must have a positive, non-zero length."),
                            ([token_range(0, 64, 50), token_range(60, 80, 50)], "Token ranges must be non-overlapping.")):
        with pytest.raises(ValueError, match=message):
            trt.KvCacheRetentionConfig(ranges, directory="")
    # The decode priority is not checked at construction (kvCacheRetentionConfig.cpp, request.cpp)...
    assert trt.KvCacheRetentionConfig([], decode_retention_priority=101, directory="").decode_retention_priority == 101
    # ...so kvgate checks it before the binding sees it.
    plan = RetentionPlan((TokenRange(0, 32, 50, None),), decode_priority=60)
    object.__setattr__(plan, "decode_priority", 101)  # what only a bug could build
    with pytest.raises(ContractError) as caught:
        retention_config(trt, plan)
    assert caught.value.tensor == "retention_decode_priority"
    ok = retention_config(trt, dataclasses.replace(plan, decode_priority=100, decode_duration_ms=5))
    assert ok.decode_retention_priority == 100 and ok.decode_duration_ms == timedelta(milliseconds=5)


def test_retention_config_sends_an_empty_directory_and_sizetype32_max_for_an_open_end(harness):
    """The 1.2 binding (ac456dca request.cpp) refuses token_end=None and an omitted directory; an open end is
    SizeType32 max (kvCacheRetentionConfig.cpp getPerBlockRetentionPriorityDuration tests tokenLoc >= tokenEnd)."""
    trt = harness.trt
    plan = RetentionPlan((TokenRange(0, 64, 80, 30_000), TokenRange(64, None, 40, None)), decode_priority=35)
    config = retention_config(trt, plan)
    ends = [r.token_end for r in config.token_range_retention_configs]
    assert ends == [64, 2**31 - 1]  # the closed end unchanged, the open end SizeType32 max (never the prompt length)
    assert config.directory == ""  # executor.h's default; used only by the GDS / POSIX transfer modes
    [sent] = [kw for name, kw in trt.calls if name == "KvCacheRetentionConfig"][-1:]
    assert sent["directory"] == ""


def test_a_retention_binding_mismatch_stops_the_model_at_load(tmp_path, monkeypatch):
    """A binding that refuses kvgate's retention config fails initialize() by name, not every request."""
    from engines.trtllm.bindings import BindingError
    from engines.trtllm.executor_args import check_retention_binding
    from tests.engines.triton import fake_trtllm

    check_retention_binding(fake_trtllm.make_module())  # the 1.2-shaped double accepts the representative config
    make_module = fake_trtllm.make_module

    def refusing(**kwargs):  # a build whose KvCacheRetentionConfig takes no `directory` keyword
        module = make_module(**kwargs)
        original = module.KvCacheRetentionConfig

        class NoDirectory(original):
            def __init__(self, *args, **kw):
                if "directory" in kw:
                    raise TypeError("__init__(): incompatible function arguments")
                super().__init__(*args, **kw)

        NoDirectory.__name__ = NoDirectory.__qualname__ = "KvCacheRetentionConfig"
        module.KvCacheRetentionConfig = NoDirectory
        return module

    with pytest.raises(BindingError, match="KvCacheRetentionConfig"):
        check_retention_binding(refusing())
    monkeypatch.setattr(fake_trtllm, "make_module", refusing)
    with pytest.raises(BindingError, match="KvCacheRetentionConfig.*incompatible function arguments"):
        make_harness(tmp_path, monkeypatch)
