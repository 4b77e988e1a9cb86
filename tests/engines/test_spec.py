"""Engine specs: the bundled files load, bad specs fail with the field named, hashes are content-only."""

from __future__ import annotations

import copy

import pytest
import yaml

from engines.spec import (
    SpecError,
    bundled_spec_names,
    load_bundled_spec,
    load_spec,
    parse_spec,
    reference_settings,
    spec_hash,
)

TRT_SPECS = ["llama-3.1-70b-instruct-fp8-tp8", "llama-3.1-8b-instruct-fp8kv"]


def test_bundled_specs():
    assert bundled_spec_names() == TRT_SPECS + ["reference-smollm2"]
    big = load_bundled_spec("llama-3.1-70b-instruct-fp8-tp8")
    assert big.build.tensor_parallel == 8 and big.build.world_size == 8
    small = load_bundled_spec("llama-3.1-8b-instruct-fp8kv")
    assert (small.quantization.weights, small.quantization.kv_cache) == ("fp8", "fp8")
    assert small.tensorrt_llm.version.startswith("1.2.")
    assert small.tensorrt_llm.container.endswith("-trtllm-python-py3")


def _raw(name: str) -> dict:
    from importlib import resources

    return yaml.safe_load((resources.files("engines") / "specs" / f"{name}.yaml").read_text())


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("build", "tokens_per_block"), 48, "power of two"),
        (("build", "max_input_len"), 9000, "max_input_len"),
        (("kv_cache", "secondary_offload_min_priority"), 101, "kv_cache.secondary_offload_min_priority"),
        (("kv_cache", "event_buffer_max_size"), 0, "event_buffer_max_size"),
        (("quantization", "kv_cache"), "fp16", "FP8"),
        (("quantization", "weights"), "int4", "quantization.weights"),
        (("tensorrt_llm", "version"), "1.3.0", "tensorrt_llm.version"),
        (("kv_cache", "host_cache_size_per_rank"), -1, "kv_cache.host_cache_size_per_rank"),
        (("build", "workers"), 2, "workers"),
        (("kv_cache", "free_gpu_memory_fraction"), 1.0, "kv_cache.free_gpu_memory_fraction"),  # TensorRT-LLM: < 1
        (("triton", "instance_count"), 2, "triton.instance_count"),  # one executor per GPU set
    ],
)
def test_invalid_specs_name_the_field(path, value, message):
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    data[path[0]][path[1]] = value
    with pytest.raises(SpecError, match=message):
        parse_spec(data, source="x.yaml")


def test_offload_threshold_must_be_explicit():
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    del data["kv_cache"]["secondary_offload_min_priority"]
    with pytest.raises(SpecError, match="secondary_offload_min_priority"):
        parse_spec(data)


def test_unknown_keys_are_refused():
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    data["kv_cache"]["secondary_offload_min_prio"] = 30
    with pytest.raises(SpecError, match="secondary_offload_min_prio"):
        parse_spec(data)


def test_model_needs_exactly_one_source():
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    data["model"]["checkpoint_path"] = "/ckpt"
    with pytest.raises(SpecError, match="exactly one"):
        parse_spec(data)


def test_load_spec_from_file_and_errors(tmp_path):
    file = tmp_path / "s.yaml"
    file.write_text(yaml.safe_dump(_raw("llama-3.1-8b-instruct-fp8kv"), sort_keys=True))
    assert spec_hash(load_spec(file)) == spec_hash(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"))
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match="no bundled spec"):
        load_spec("nope")


def test_hash_changes_with_content():
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    before = spec_hash(parse_spec(data))
    data["kv_cache"]["host_cache_size_per_rank"] += 1
    assert spec_hash(parse_spec(data)) != before


def test_reference_spec_maps_to_the_reference_engine_config():
    settings = reference_settings(load_bundled_spec("reference-smollm2"))
    assert settings["kv_dtype"] == "fp8_e4m3" and settings["max_output_len"] == 1024
    config_module = pytest.importorskip("engines.reference.config")
    config = config_module.ReferenceEngineConfig(**settings)
    assert config.secondary_offload_min_priority == 35
    with pytest.raises(SpecError):
        reference_settings(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"))


# --- the rules the validator enforces, each named with its source ---------------------------

def _invalid(mutate) -> str:
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    mutate(data)
    with pytest.raises(SpecError) as caught:
        parse_spec(data, source="x.yaml")
    return str(caught.value)


def test_onboarding_off_is_refused_naming_the_rule_and_its_source():
    message = _invalid(lambda d: d["kv_cache"].update(onboard_blocks=False))
    assert "kv_cache" in message and "[rule onboard-blocks]" in message
    assert "trtGptModelInflightBatching.cpp" in message and "KV cache blocks need to be onboarded" in message


def test_full_precision_weights_with_fp8_kv_are_refused_naming_the_rule_and_its_source():
    message = _invalid(lambda d: (d["quantization"].update(weights="none"), d["build"].update(gemm_plugin="auto")))
    assert "[rule fp8-kv-needs-fp8-weights]" in message and "tensorrt_llm/builder.py" in message
    assert "SM >= 89" in message


def test_host_cache_size_is_per_rank_and_the_ambiguous_key_is_refused():
    message = _invalid(lambda d: d["kv_cache"].update(host_cache_size=d["kv_cache"].pop("host_cache_size_per_rank")))
    assert "[rule host-cache-per-rank]" in message and "calculateFreeMemBytes" in message
    big = load_bundled_spec("llama-3.1-70b-instruct-fp8-tp8")
    assert big.pinned_host_bytes_per_rank() == 32 << 30  # not 256 GiB per rank: 8 ranks would pin 2 TiB
    assert big.pinned_host_bytes_total() == 256 << 30
    small = load_bundled_spec("llama-3.1-8b-instruct-fp8kv")
    assert small.pinned_host_bytes_per_rank() == small.pinned_host_bytes_total() == 32 << 30


def test_max_num_tokens_below_a_block_is_refused_naming_the_rule_and_its_source():
    message = _invalid(lambda d: d["build"].update(max_num_tokens=16))
    assert "[rule chunk-unit-block]" in message and "trtGptModelInflightBatching.cpp" in message
    assert "max_num_tokens (16) must be >= tokens_per_block (32)" in message
    data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
    data["build"]["max_num_tokens"] = 2048  # below max_input_len 7168: served with chunked context
    assert parse_spec(data).build.max_num_tokens == 2048


def test_container_must_name_its_registry_host():
    for spec_name in TRT_SPECS:
        # server r26.04 docs/introduction/compatibility.md: the NGC tag of the 26.04 trtllm image
        assert load_bundled_spec(spec_name).tensorrt_llm.container == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    message = _invalid(lambda d: d["tensorrt_llm"].update(container="nvidia/tritonserver:26.04-trtllm-python-py3"))
    assert "[rule container-registry-host]" in message and "compatibility.md" in message
    for mirror in ("registry.example.com:5000/nvidia/tritonserver:26.04-trtllm-python-py3",
                   "localhost/tritonserver:26.04-trtllm-python-py3"):
        data = copy.deepcopy(_raw("llama-3.1-8b-instruct-fp8kv"))
        data["tensorrt_llm"]["container"] = mirror
        assert parse_spec(data).tensorrt_llm.container == mirror


# --- model.revision: which commit of the Hugging Face repo a build takes ---------------------

SHA = "0e9e39f249a16976918f6564b8830bc894c89659"


def _with_model(**model) -> dict:
    data = copy.deepcopy(_raw("llama-3.1-70b-instruct-fp8-tp8"))
    data["model"] = {**data["model"], **model}
    return data


@pytest.mark.parametrize("revision", [SHA, "v1.0", "main", "release/2025-01", "refs/pr/12", "exp/o'brien;$x"])
def test_a_revision_is_a_commit_or_a_ref_name(revision):
    spec = parse_spec(_with_model(revision=revision))
    assert spec.model.revision == revision
    assert spec.model.pinned_commit == (revision if revision == SHA else None)


@pytest.mark.parametrize("revision", ["", "-rf", "a..b", "has space", "x~1", "a:b", "end/", "/start", "x.lock",
                                      "v@{1}", "A" * 40 + "x" * 300])
def test_a_revision_git_would_refuse_is_refused(revision):
    with pytest.raises(SpecError, match=r"model\.revision: .*a commit sha \(40 hex digits\) or a branch or tag name"):
        parse_spec(_with_model(revision=revision))


def test_a_revision_with_a_checkpoint_path_is_refused_naming_the_rule():
    message = _invalid(lambda d: d.update(model={"checkpoint_path": "/ckpt/llama", "revision": SHA}))
    assert "[rule revision-needs-hf-id]" in message and "checkpoint_path" in message
    assert "snapshot_download" in message  # the source: huggingface_hub's revision argument


def test_the_revision_is_part_of_the_spec_hash():
    unpinned, pinned = parse_spec(_with_model()), parse_spec(_with_model(revision=SHA))
    assert spec_hash(unpinned) != spec_hash(pinned)
    assert spec_hash(pinned) != spec_hash(parse_spec(_with_model(revision="v1.0")))


def test_an_unpinned_hf_id_is_valid_but_warned_about():
    from engines.spec import spec_warnings

    unpinned = parse_spec(_with_model())
    [warning] = spec_warnings(unpinned)
    assert "meta-llama/Llama-3.1-70B-Instruct" in warning and "not reproducible" in warning
    assert "model.revision" in warning
    [moving] = spec_warnings(parse_spec(_with_model(revision="main")))
    assert "'main'" in moving and "can move" in moving
    assert spec_warnings(parse_spec(_with_model(revision=SHA))) == []
    assert spec_warnings(load_bundled_spec("reference-smollm2")) == []  # a local checkpoint: nothing to pin
    [tokenizer] = spec_warnings(parse_spec(_with_model(revision=SHA, tokenizer="acme/tok")))
    assert "model.tokenizer 'acme/tok'" in tokenizer
