"""Contract: the rendered config.pbtxt of every TensorRT-LLM spec, parsed back with model_config_pb2."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from engines import contract, response_tensors
from engines.spec import load_bundled_spec, spec_hash
from engines.triton.params import ParamsError, ServingParams
from engines.triton.repository import (
    ConfigValues,
    TemplateError,
    config_template,
    model_source,
    render_config,
    render_repository,
    render_template,
)

# Names and types of inputs/outputs follow the stock tensorrt_llm model where one exists:
# tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt (engines/contract.py).
INPUTS = {
    "input_ids": ("TYPE_INT32", [-1]),
    "request_output_len": ("TYPE_INT32", [1]),
    "end_id": ("TYPE_INT32", [1]),
    "streaming": ("TYPE_BOOL", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "runtime_top_p": ("TYPE_FP32", [1]),
    "runtime_top_k": ("TYPE_INT32", [1]),
    "random_seed": ("TYPE_UINT64", [1]),
    "stop": ("TYPE_BOOL", [1]),
    "retention_token_range_starts": ("TYPE_INT32", [-1]),
    "retention_token_range_ends": ("TYPE_INT32", [-1]),
    "retention_token_range_priorities": ("TYPE_INT32", [-1]),
    "retention_token_range_durations_ms": ("TYPE_INT32", [-1]),
    "retention_decode_priority": ("TYPE_INT32", [1]),
    "retention_decode_duration_ms": ("TYPE_INT32", [1]),
    "cache_salt": ("TYPE_STRING", [1]),
    "tenant_id": ("TYPE_STRING", [1]),
    "kv_stats": ("TYPE_BOOL", [1]),
    # request extensions (stock names from TensorRT-LLM triton_backend tensorrt_llm/config.pbtxt, or kvgate's)
    "repetition_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]),
    "min_tokens": ("TYPE_INT32", [1]),
    "ignore_eos": ("TYPE_BOOL", [1]),
    "return_log_probs": ("TYPE_BOOL", [1]),
    "num_top_log_probs": ("TYPE_INT32", [1]),
    "logit_bias_token_ids": ("TYPE_INT32", [-1]),
    "logit_bias_values": ("TYPE_FP32", [-1]),
    "guided_decoding_guide_type": ("TYPE_STRING", [1]),
    "guided_decoding_guide": ("TYPE_STRING", [1]),
    "kv_events_since": ("TYPE_UINT64", [1]),
}
OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1]),
    "sequence_length": ("TYPE_INT32", [1]),
    "kv_cache_reused_blocks": ("TYPE_INT32", [1]),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", [1]),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", [1]),
    "kv_cache_onboarded_blocks": ("TYPE_INT32", [1]),
    "kv_cache_stats": ("TYPE_STRING", [1]),
    "output_log_probs": ("TYPE_FP32", [-1]),
    "top_log_probs": ("TYPE_FP32", [-1, -1]),
    "top_log_probs_token_ids": ("TYPE_INT32", [-1, -1]),
}


def expected_parameters(name: str) -> dict[str, str]:
    spec = load_bundled_spec(name)
    per_spec = {
        "llama-3.1-8b-instruct-fp8kv": {
            "kv_cache_free_gpu_mem_fraction": "0.85",
            "kv_cache_host_memory_bytes": "34359738368",
            "kv_cache_event_buffer_max_size": "16384",
            "kvgate_max_batch_size": "64",
            "kvgate_max_input_len": "7168",
            "kvgate_max_output_len": "1024",
            "kvgate_max_num_tokens": "8192",
            "kvgate_world_size": "1",  # build.tensor_parallel * pipeline_parallel
        },
        "llama-3.1-70b-instruct-fp8-tp8": {
            "kv_cache_free_gpu_mem_fraction": "0.9",
            # per rank, like the stock key (tensorrtllm_backend passes it to KvCacheConfig.host_cache_size):
            # 8 ranks x 32 GiB = 256 GiB per replica
            "kv_cache_host_memory_bytes": "34359738368",
            "kv_cache_event_buffer_max_size": "65536",
            "kvgate_max_batch_size": "128",
            "kvgate_max_input_len": "15360",
            "kvgate_max_output_len": "1024",
            "kvgate_max_num_tokens": "16384",
            "kvgate_world_size": "8",  # TP=8: executor in orchestrator mode
        },
    }[name]
    return {
        "engine_dir": f"/engines/{name}/engine",  # tensorrtllm_backend docs/model_config.md
        "enable_kv_cache_reuse": "true",  # tensorrtllm_backend docs/model_config.md
        "max_tokens_in_paged_kv_cache": "",  # tensorrtllm_backend docs/model_config.md (unset = no cap)
        "kv_cache_onboard_blocks": "true",  # stock C++ model reads it: TensorRT-LLM triton_backend/inflight_batcher_llm/src/model_instance_state.cc
        "kv_cache_secondary_offload_min_priority": "35",  # kvgate; KvCacheConfig secondary_offload_min_priority (executorConfig.cpp)
        "kv_cache_enable_partial_reuse": "true",  # kvgate; KvCacheConfig enable_partial_reuse (executorConfig.cpp)
        "kv_cache_copy_on_partial_reuse": "true",  # kvgate; KvCacheConfig copy_on_partial_reuse (executorConfig.cpp)
        "iter_stats_max_iterations": "1000",  # tensorrtllm_backend docs/model_config.md
        "max_queue_size": "",  # tensorrtllm_backend docs/model_config.md (unset)
        "kvgate_spec_name": name,
        "kvgate_spec_hash": spec_hash(spec),
        "kvgate_tensorrt_llm_version": "1.2.1",
        "kvgate_tokens_per_block": "32",
        "kvgate_vocab_size": "128256",
        "kvgate_end_id": "128009",
        "kvgate_response_poll_ms": "5",
        # tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/1/model.py (get_parallel_config)
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
        # stock tensorrt_llm model key: GuidedDecodingConfig is built from its tokenizer.json
        "tokenizer_dir": f"/engines/tokenizers/{name}",
        **per_spec,  # the KV / limit values above, each from the spec
    }


NAMES = ["llama-3.1-8b-instruct-fp8kv", "llama-3.1-70b-instruct-fp8-tp8"]


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize("name", NAMES)
def test_config_pbtxt(name):
    config = parse(render_config(load_bundled_spec(name), engine_dir=f"/engines/{name}/engine",
                                 tokenizer_dir=f"/engines/tokenizers/{name}"))
    assert config.name == "kvgate_llm"
    assert config.backend == "python"  # python_backend README: backend: "python"
    assert config.max_batch_size == 0  # engines/contract.py: shapes carry no batch dimension
    assert config.model_transaction_policy.decoupled is True  # python_backend README, decoupled mode
    got_inputs = {i.name: (model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in config.input}
    assert got_inputs == INPUTS
    assert all(i.optional for i in config.input)
    got_outputs = {o.name: (model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in config.output}
    assert got_outputs == OUTPUTS
    [group] = config.instance_group
    assert (group.count, model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)) == (1, "KIND_CPU")
    assert {k: v.string_value for k, v in config.parameters.items()} == expected_parameters(name)


def test_contract_and_config_agree():
    assert {s.name for s in contract.INPUTS} == set(INPUTS)
    assert {s.name for s in response_tensors.OUTPUTS} == set(OUTPUTS)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_round_trip_through_triton_json(name):
    spec = load_bundled_spec(name)
    params = ServingParams.from_spec(spec, engine_dir="/engines/e")
    config = parse(render_config(spec, engine_dir="/engines/e"))
    as_json = json_format.MessageToJson(config, preserving_proto_field_name=True)
    assert ServingParams.from_model_config(as_json) == params


def test_bad_parameters_name_the_key():
    raw = ServingParams.from_spec(load_bundled_spec(NAMES[0]), engine_dir="/e").to_parameters()
    del raw["kv_cache_secondary_offload_min_priority"]
    with pytest.raises(ParamsError, match="kv_cache_secondary_offload_min_priority"):
        ServingParams.from_parameters(raw)
    raw = ServingParams.from_spec(load_bundled_spec(NAMES[0]), engine_dir="/e").to_parameters()
    raw["enable_kv_cache_reuse"] = "yes"
    with pytest.raises(ParamsError, match="enable_kv_cache_reuse"):
        ServingParams.from_parameters(raw)
    raw["enable_kv_cache_reuse"] = "true"
    raw["kvgate_vocab_size"] = ""
    with pytest.raises(ParamsError, match="kvgate_vocab_size"):
        ServingParams.from_parameters(raw)


def test_template_must_be_filled_exactly():
    values = ConfigValues("m", "s", "h", 1, "input []", "output []", "")
    rendered = render_template(config_template(), values)
    assert "${" not in rendered and "$" not in rendered.replace("$$", "")

    @dataclasses.dataclass(frozen=True)
    class Missing:
        model_name: str

    with pytest.raises(TemplateError, match="unfilled"):
        render_template(config_template(), Missing("m"))

    @dataclasses.dataclass(frozen=True)
    class Extra:
        a: str
        b: str

    with pytest.raises(TemplateError, match=r"unused \['b'\]"):
        render_template("x ${a}", Extra("1", "2"))
    with pytest.raises(TemplateError, match="invalid"):
        render_template("x $", Extra("1", "2"))


def test_render_repository(tmp_path):
    specs = [load_bundled_spec(n) for n in NAMES[:1]]
    [model] = render_repository(specs, tmp_path, engines_root="/engines/")
    assert model.config_path == tmp_path / "kvgate_llm" / "config.pbtxt"
    assert model.model_path.read_bytes() == model_source()
    parameters = parse(model.config_path.read_text()).parameters
    assert parameters["engine_dir"].string_value == f"/engines/{NAMES[0]}/engine"
    # Guided decoding: the tokenizer the engine builder saves (build/engine_builder.sh, Helm's builder job).
    assert parameters["tokenizer_dir"].string_value == f"/engines/tokenizers/{NAMES[0]}"
    with pytest.raises(TemplateError, match="same Triton model name"):
        render_repository([load_bundled_spec(n) for n in NAMES], tmp_path / "two", engines_root="/engines")


def test_reference_spec_is_not_a_triton_model():
    with pytest.raises(ParamsError):
        render_config(load_bundled_spec("reference-smollm2"), engine_dir="/e")
