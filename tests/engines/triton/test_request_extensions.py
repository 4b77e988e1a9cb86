"""Request-extension inputs through the kvgate_llm Triton model into the 1.2 executor double.

Each mapping's source is cited in engines/trtllm/request_extensions.py; the double
(fake_trtllm.py) refuses what the bindings refuse (types, SamplingConfig checks).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import engines.response_tensors as response_tensors
from engines.contract import EngineRequest, Guide, SamplingParams, encode_request
from engines.tokenizer import load_gguf_tokenizer
from retention.types import RetentionPlan
from tests.engines.triton.conftest import make_harness
from tests.engines.triton.test_model import PROMPT, error_of, outputs, recorded_request


def request(**changes) -> dict[str, np.ndarray]:
    base = dict(input_ids=PROMPT[:5], max_new_tokens=4, end_id=None, streaming=False, sampling=SamplingParams(),
                retention=RetentionPlan(), cache_salt=None, tenant_id=None)
    base.update(changes)
    return encode_request(EngineRequest(**base))


def test_penalties_and_min_tokens_reach_the_sampling_config(harness):
    outputs(harness.send(request()))
    plain = recorded_request(harness).sampling_config
    assert (plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty, plain.min_tokens) == (None,) * 4
    sampling = SamplingParams(temperature=0.5, repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-1.0,
                              min_tokens=3)
    outputs(harness.send(request(sampling=sampling)))
    config = recorded_request(harness).sampling_config
    assert config.repetition_penalty == pytest.approx(1.25) and config.presence_penalty == pytest.approx(0.5)
    assert config.frequency_penalty == pytest.approx(-1.0) and config.min_tokens == 3


def test_log_probs_are_asked_for_and_returned_aligned_with_the_tokens(harness):
    for streaming in (False, True):
        tensors = request(streaming=streaming, return_log_probs=True, end_id=77)
        responses = outputs(harness.send(tensors))
        assert recorded_request(harness).output_config.return_log_probs is True
        tokens = [t for r, _ in responses for t in r[response_tensors.OUTPUT_IDS.name].tolist()]
        log_probs = [v for r, _ in responses
                     for v in r.get(response_tensors.OUTPUT_LOG_PROBS.name, np.zeros(0)).tolist()]
        assert len(tokens) == 4 and log_probs == pytest.approx([-0.5 - 0.01 * t for t in tokens])
    outputs(harness.send(request()))
    assert recorded_request(harness).output_config.return_log_probs is False


def test_top_log_probs_are_refused_by_name(harness):
    message = error_of(harness.send(request(return_log_probs=True, num_top_log_probs=2)))
    assert "num_top_log_probs" in message
    assert len(harness.executor.requests) == 0


def test_ignore_eos_sends_end_id_minus_one_and_logit_bias_a_dense_embedding_bias(harness):
    outputs(harness.send(request(end_id=77, ignore_eos=True)))
    assert recorded_request(harness).end_id == -1  # executor/base_worker.py: end_id=-1 if ignore_eos
    outputs(harness.send(request(sampling=SamplingParams(logit_bias=((5, 2.0), (9, -100.0))))))
    bias = recorded_request(harness).embedding_bias
    # createNewDecoderRequests.cpp initializeEmbeddingBias: [1, vocab_size] in the logits dtype
    assert tuple(bias.shape) == (1, harness.model.params.vocab_size) and str(bias.dtype) == "torch.float32"
    assert float(bias[0, 5]) == 2.0 and float(bias[0, 9]) == -100.0 and float(bias.abs().sum()) == 102.0


def test_guides_are_refused_without_a_tokenizer(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch, parameters={"tokenizer_dir": ""})  # an operator cleared it
    try:
        message = error_of(h.send(request(guide=Guide("json_schema", '{"type": "object"}'))))
        assert "guided_decoding_guide_type" in message and "tokenizer_dir" in message
    finally:
        h.model.finalize()


def test_guided_decoding_config_and_params_with_a_tokenizer(tmp_path, monkeypatch):
    tokenizer = load_gguf_tokenizer()
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    h = make_harness(tmp_path, monkeypatch, parameters={"tokenizer_dir": str(tokenizer_dir)})
    try:
        [config] = [kw for name, kw in h.trt.calls if name == "GuidedDecodingConfig"]
        assert config["backend"] is h.trt.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
        assert config["vocab_size"] == tokenizer.vocab_size
        assert config["stop_token_ids"] == [h.model.params.end_id]
        assert h.executor.config.guided_decoding_config is not None
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
        outputs(h.send(request(guide=Guide("json_schema", schema))))
        params = recorded_request(h).guided_decoding_params
        assert params.guide_type is h.trt.GuidedDecodingParams.GuideType.JSON_SCHEMA and params.guide == schema
        outputs(h.send(request(guide=Guide("json"))))
        params = recorded_request(h).guided_decoding_params
        assert params.guide_type is h.trt.GuidedDecodingParams.GuideType.JSON and params.guide is None
        # `json` with a schema text: GuideType.JSON would compile the builtin JSON grammar and ignore the
        # text (guidedDecoder.cpp kJSON -> CompileBuiltinJSONGrammar); the reference engine enforces the schema.
        outputs(h.send(request(guide=Guide("json", schema))))
        params = recorded_request(h).guided_decoding_params
        assert params.guide_type is h.trt.GuidedDecodingParams.GuideType.JSON_SCHEMA and params.guide == schema
    finally:
        h.model.finalize()


def test_the_double_refuses_what_the_bindings_refuse(harness):
    trt = harness.trt
    with pytest.raises(RuntimeError):  # samplingConfig.cpp checkRepetitionPenalty
        trt.SamplingConfig(repetition_penalty=0.0)
    with pytest.raises(RuntimeError):  # checkMinTokens
        trt.SamplingConfig(min_tokens=-1)
    with pytest.raises(TypeError):
        trt.GuidedDecodingParams("json_schema", "{}")  # needs the GuideType enum
    with pytest.raises(TypeError):
        trt.Request([1, 2], 4, embedding_bias=[0.0, 1.0])  # std::optional<Tensor>
