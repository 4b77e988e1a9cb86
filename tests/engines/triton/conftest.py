"""Fixtures: a rendered model repository and the kvgate_llm model driven by the two doubles."""

from __future__ import annotations

import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from engines.spec import load_bundled_spec
from engines.triton.repository import render_repository
from tests.engines.triton import fake_pb_utils, fake_trtllm

SPEC = "llama-3.1-8b-instruct-fp8kv"


def load_model_module(path: Path, name: str):
    """Import a rendered ``1/model.py`` the way Triton's Python backend does: as a file."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Harness:
    """The model with its response thread stopped, pumped by hand: deterministic, no waits."""

    def __init__(self, model, module, pb, trt, params):
        self.model, self.module, self.pb, self.trt, self.params = model, module, pb, trt, params
        self.executor = trt.executors[-1]

    def send(self, tensors):
        request = self.pb.InferenceRequest(tensors)
        self.model.execute([request])
        self.model.pump(timedelta(0))
        return request.sender


def write_tokenizer(directory: Path, vocab: tuple[str, ...] = ("{", "}", '"', ":", "a", "1")) -> Path:
    """A minimal Hugging Face ``tokenizer.json`` (the fields request_extensions.guided_decoding_config reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": []},
                                "added_tokens": [{"id": len(vocab), "content": "<|eot_id|>", "special": True}]}))
    return path


def make_harness(tmp_path, monkeypatch, *, salt_supported=True, spec_name=SPEC, version="1.2.1", spec=None,
                 engine: dict | None = None, kv_cache_stats=True, write_engine=True,
                 parameters=None, event_lag=0, tokenizer=True):
    """The model over a rendered repository and an engine directory holding a trtllm-build ``config.json``.

    ``engine`` overrides fields of that config.json (``fake_trtllm.write_engine_config``), e.g.
    ``{"paged_context_fmha": False}`` for what builder.py produces for FP8 KV without FP8 weights.
    """
    pb = fake_pb_utils.make_module()
    trt = fake_trtllm.make_module(salt_supported=salt_supported, version=version, kv_cache_stats=kv_cache_stats,
                                  event_lag=event_lag)
    fake_pb_utils.install(pb, monkeypatch)
    fake_trtllm.install(trt, monkeypatch)
    spec = spec if spec is not None else load_bundled_spec(spec_name)
    engines_root = tmp_path / "engines"
    if write_engine:
        fake_trtllm.write_engine_config(
            engines_root / spec.name / "engine",
            **{"tokens_per_block": spec.build.tokens_per_block, "tp_size": spec.build.tensor_parallel,
               "vocab_size": spec.triton.vocab_size, "max_input_len": spec.build.max_input_len,
               "max_seq_len": spec.build.max_seq_len, "max_num_tokens": spec.build.max_num_tokens, **(engine or {})},
        )
    if tokenizer:  # what the engine builder saves under /engines/tokenizers/<spec> (build/engine_builder.sh)
        write_tokenizer(engines_root / "tokenizers" / spec.name)
    [rendered] = render_repository([spec], tmp_path / "repo", engines_root=str(engines_root))
    config = text_format.Parse(rendered.config_path.read_text(), model_config_pb2.ModelConfig())
    for key, value in (parameters or {}).items():  # what an operator adds to config.pbtxt
        config.parameters[key].string_value = value
    config_json = json_format.MessageToJson(config, preserving_proto_field_name=True)
    module_name = f"kvgate_model_{id(tmp_path)}"
    monkeypatch.setitem(sys.modules, module_name, None)
    module = load_model_module(rendered.model_path, module_name)
    model = module.TritonPythonModel()
    model.initialize({"model_config": config_json, "model_instance_kind": "CPU", "model_name": spec.triton.model_name})
    model.stopping.set()
    model.thread.join(timeout=10)
    assert not model.thread.is_alive()
    return Harness(model, module, pb, trt, json.loads(config_json))


@pytest.fixture
def harness(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch)
    yield h
    h.model.finalize()
