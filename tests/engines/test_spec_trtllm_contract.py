"""Contract: for each TensorRT-LLM spec, the exact build commands and executor arguments.

Every expected key carries the source file it was checked against: TensorRT-LLM 1.2-era
sources (binding files read in main-branch snapshots on both sides of the release/1.2
branch point, quantize.py at 059c97c1; the v1.2.1 tag itself was not readable here — see
docs/architecture.md "Production path"). The expectations are written out by hand, not computed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.spec import load_bundled_spec
from engines.triton.params import ServingParams
from engines.trtllm.build_plan import BuildPlanError, build_plan
from engines.trtllm.executor_args import executor_config_kwargs, kv_cache_config_kwargs

DOWNLOAD_8B = {  # kvgate build download (engines/trtllm/engine_build.py download_hf_model): quantize.py has no revision
    "--hf-id": "meta-llama/Llama-3.1-8B-Instruct",
    "--revision": "0e9e39f249a16976918f6564b8830bc894c89659",  # the bundled spec's model.revision
    "--output": "/engines/llama-3.1-8b-instruct-fp8kv/source",
}
QUANTIZE_8B = {
    # examples/quantization/quantize.py; the snapshot the download step linked (tensorrt_llm/quantization/
    # quantize_by_modelopt.py loads it with from_pretrained, as it would a hub id, without a revision)
    "--model_dir": "/engines/llama-3.1-8b-instruct-fp8kv/source/meta-llama/Llama-3.1-8B-Instruct",
    "--dtype": "bfloat16",  # examples/quantization/quantize.py (choices auto/float16/bfloat16/float32)
    "--qformat": "fp8",  # examples/quantization/quantize.py (choices incl. fp8, full_prec)
    "--kv_cache_dtype": "fp8",  # examples/quantization/quantize.py (choices int8, fp8)
    "--calib_size": "512",  # examples/quantization/quantize.py
    "--batch_size": "1",  # examples/quantization/quantize.py (calibration batch)
    "--tp_size": "1",  # examples/quantization/quantize.py
    "--pp_size": "1",  # examples/quantization/quantize.py
    "--output_dir": "/engines/llama-3.1-8b-instruct-fp8kv/checkpoint",  # examples/quantization/quantize.py
}
BUILD_8B = {
    "--checkpoint_dir": "/engines/llama-3.1-8b-instruct-fp8kv/checkpoint",  # tensorrt_llm/commands/build.py
    "--output_dir": "/engines/llama-3.1-8b-instruct-fp8kv/engine",  # tensorrt_llm/commands/build.py
    "--gemm_plugin": "fp8",  # tensorrt_llm/plugin/plugin.py (add_plugin_argument)
    "--kv_cache_type": "paged",  # tensorrt_llm/commands/build.py (enum KVCacheType)
    "--use_paged_context_fmha": "enable",  # tensorrt_llm/plugin/plugin.py; needed for KV reuse
    "--tokens_per_block": "32",  # tensorrt_llm/plugin/plugin.py
    "--max_batch_size": "64",  # tensorrt_llm/commands/build.py
    "--max_input_len": "7168",  # tensorrt_llm/commands/build.py
    "--max_seq_len": "8192",  # tensorrt_llm/commands/build.py
    "--max_num_tokens": "8192",  # tensorrt_llm/commands/build.py
    "--max_beam_width": "1",  # tensorrt_llm/commands/build.py
    "--workers": "1",  # tensorrt_llm/commands/build.py
}
DOWNLOAD_70B = {  # no --revision: the bundled 70B spec is unpinned (the build records the commit it got)
    "--hf-id": "meta-llama/Llama-3.1-70B-Instruct",
    "--output": "/engines/llama-3.1-70b-instruct-fp8-tp8/source",
}
QUANTIZE_70B = {
    **QUANTIZE_8B,
    "--model_dir": "/engines/llama-3.1-70b-instruct-fp8-tp8/source/meta-llama/Llama-3.1-70B-Instruct",  # quantize.py
    "--tp_size": "8",  # examples/quantization/quantize.py: TP is fixed in the checkpoint
    "--output_dir": "/engines/llama-3.1-70b-instruct-fp8-tp8/checkpoint",  # examples/quantization/quantize.py
}
BUILD_70B = {
    **BUILD_8B,
    "--checkpoint_dir": "/engines/llama-3.1-70b-instruct-fp8-tp8/checkpoint",  # tensorrt_llm/commands/build.py
    "--output_dir": "/engines/llama-3.1-70b-instruct-fp8-tp8/engine",  # tensorrt_llm/commands/build.py
    "--max_batch_size": "128",  # tensorrt_llm/commands/build.py
    "--max_input_len": "15360",  # tensorrt_llm/commands/build.py
    "--max_seq_len": "16384",  # tensorrt_llm/commands/build.py
    "--max_num_tokens": "16384",  # tensorrt_llm/commands/build.py
    "--workers": "8",  # tensorrt_llm/commands/build.py: one build process per rank
}

KV_8B = {
    "enable_block_reuse": True,  # cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp (KvCacheConfig)
    "free_gpu_memory_fraction": 0.85,  # executorConfig.cpp
    "host_cache_size": 34359738368,  # executorConfig.cpp (bytes, std::optional<size_t>)
    "secondary_offload_min_priority": 35,  # executorConfig.cpp; C++ default 30 in executor.h, never relied on
    "event_buffer_max_size": 16384,  # executorConfig.cpp (size_t)
    "enable_partial_reuse": True,  # executorConfig.cpp (keyword-only)
    "copy_on_partial_reuse": True,  # executorConfig.cpp (keyword-only)
}
KV_70B = {
    **KV_8B,
    "free_gpu_memory_fraction": 0.9,  # executorConfig.cpp
    "host_cache_size": 34359738368,  # executorConfig.cpp; per rank (each of 8 ranks pins it: 256 GiB per replica)
    "event_buffer_max_size": 65536,  # executorConfig.cpp
}
EXECUTOR_8B = {
    "max_beam_width": 1,  # executorConfig.cpp (ExecutorConfig)
    "iter_stats_max_iterations": 1000,  # executorConfig.cpp; stats call reads IterationStats.kv_cache_stats
    "max_batch_size": 64,  # executorConfig.cpp
    "max_num_tokens": 8192,  # executorConfig.cpp
    # executorConfig.cpp: nb::arg("normalize_log_probs") = true in 1.2; the contract's log probabilities are unnormalised
    "normalize_log_probs": False,
    # executorConfig.cpp: nb::arg("enable_chunked_context") = false; max_num_tokens < max_input_len needs it
    # (batch_manager/trtGptModel.h: without it the max input is min(max_seq_len - 1, max_num_tokens))
    "enable_chunked_context": True,
}
EXECUTOR_70B = {**EXECUTOR_8B, "max_batch_size": 128, "max_num_tokens": 16384}

CASES = {
    "llama-3.1-8b-instruct-fp8kv": (QUANTIZE_8B, BUILD_8B, KV_8B, EXECUTOR_8B),
    "llama-3.1-70b-instruct-fp8-tp8": (QUANTIZE_70B, BUILD_70B, KV_70B, EXECUTOR_70B),
}
DOWNLOADS = {"llama-3.1-8b-instruct-fp8kv": DOWNLOAD_8B, "llama-3.1-70b-instruct-fp8-tp8": DOWNLOAD_70B}


@pytest.mark.parametrize("name", sorted(CASES))
def test_build_commands(name):
    quantize, trtllm_build, _, _ = CASES[name]
    plan = build_plan(load_bundled_spec(name), output_dir="/engines")
    download, first, second = plan.commands
    assert download.argv[:3] == ("kvgate", "build", "download") and download.flags() == DOWNLOADS[name]
    assert first.argv[:2] == ("python3", "/app/examples/quantization/quantize.py")  # -trtllm-python-py3 image: /app/examples
    assert first.flags() == quantize
    assert second.argv[0] == "trtllm-build"  # console script -> tensorrt_llm/commands/build.py:main
    assert second.flags() == trtllm_build
    world = load_bundled_spec(name).build.world_size
    assert plan.expected_artifacts == ("config.json",) + tuple(f"rank{r}.engine" for r in range(world))


@pytest.mark.parametrize("name", sorted(CASES))
def test_executor_arguments(name):
    _, _, kv, executor = CASES[name]
    params = ServingParams.from_spec(load_bundled_spec(name), engine_dir="/engines/x/engine")
    assert kv_cache_config_kwargs(params) == kv
    marker = SimpleNamespace()
    built = executor_config_kwargs(params, marker)
    assert built.pop("kv_cache_config") is marker
    assert built == executor


def test_optional_kv_fields_are_passed_only_when_set():
    params = ServingParams.from_spec(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"), engine_dir="/e")
    object.__setattr__(params, "max_tokens", 65536)
    object.__setattr__(params, "max_queue_size", 256)
    assert kv_cache_config_kwargs(params)["max_tokens"] == 65536  # executorConfig.cpp
    assert executor_config_kwargs(params, None)["max_queue_size"] == 256  # executorConfig.cpp
    assert "onboard_blocks" not in kv_cache_config_kwargs(params)  # default true; removed on main by PR #12449
    object.__setattr__(params, "onboard_blocks", False)
    assert kv_cache_config_kwargs(params)["onboard_blocks"] is False  # executorConfig.cpp (every pre-#12449 snapshot)


def test_calibration_dataset_is_passed_to_quantize():
    spec = load_bundled_spec("llama-3.1-8b-instruct-fp8kv")
    changed = spec.model_copy(update={"quantization": spec.quantization.model_copy(update={"calib_dataset": "/data/calib"})})
    [quantize] = [c for c in build_plan(changed, output_dir="/e").commands if c.step == "quantize"]
    assert quantize.flag("--qformat") == "fp8"  # full_prec is refused by the spec (rule fp8-kv-needs-fp8-weights)
    assert quantize.flag("--kv_cache_dtype") == "fp8"
    assert quantize.flag("--calib_dataset") == "/data/calib"  # examples/quantization/quantize.py


def test_reference_spec_has_no_build():
    with pytest.raises(BuildPlanError, match="no TensorRT-LLM engine"):
        build_plan(load_bundled_spec("reference-smollm2"), output_dir="/e")


# --- the model's revision: examples/quantization/quantize.py (059c97c1) has no --revision, and
# tensorrt_llm/quantization/quantize_by_modelopt.py (042c510d) loads --model_dir with
# AutoConfig/AutoModelForCausalLM/AutoTokenizer.from_pretrained(ckpt_path, ...) without one: a hub id
# passed there is read at the repo's main branch. So a hub model is downloaded first, at the revision.

def _spec_with_model(**model):
    from engines.spec import parse_spec

    data = load_bundled_spec("llama-3.1-70b-instruct-fp8-tp8").model_dump(mode="json")
    data["model"] = {"hf_id": None, "checkpoint_path": None, "tokenizer": None, **model}
    return parse_spec(data)


def test_a_hub_model_is_downloaded_at_its_revision_before_quantize():
    sha = "0123456789abcdef0123456789abcdef01234567"
    plan = build_plan(_spec_with_model(hf_id="meta-llama/Llama-3.1-70B-Instruct", revision=sha), output_dir="/engines")
    download, quantize, trtllm_build = plan.commands
    root = "/engines/llama-3.1-70b-instruct-fp8-tp8"
    assert download.step == "download"
    assert download.argv == ("kvgate", "build", "download", "--hf-id", "meta-llama/Llama-3.1-70B-Instruct",
                             "--revision", sha, "--output", f"{root}/source")
    # quantize.py reads the downloaded snapshot, never the hub (whose main may have moved since)
    assert quantize.flag("--model_dir") == f"{root}/source/meta-llama/Llama-3.1-70B-Instruct"
    assert trtllm_build.argv[0] == "trtllm-build"
    unpinned = build_plan(_spec_with_model(hf_id="meta-llama/Llama-3.1-70B-Instruct"), output_dir="/engines")
    assert "--revision" not in unpinned.commands[0].argv  # the hub's default branch; the build records its commit
    # a local checkpoint has nothing to download: quantize.py reads it where it is
    plan = build_plan(_spec_with_model(checkpoint_path="/ckpt/llama-70b"), output_dir="/engines")
    assert [c.step for c in plan.commands] == ["quantize", "trtllm-build"]
    assert plan.commands[0].flag("--model_dir") == "/ckpt/llama-70b"


def test_a_revision_reaches_the_download_as_one_argument_and_the_dry_run_quotes_it(tmp_path):
    import shlex

    import yaml
    from typer.testing import CliRunner

    from server.cli import create_cli

    revision = "exp/o'brien;$x"  # legal in git ref names; the plan is argv, never a shell string
    spec = _spec_with_model(hf_id="acme/model", revision=revision)
    assert build_plan(spec, output_dir="/e").commands[0].flag("--revision") == revision
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(create_cli(), ["build", "engine", str(path), "--dry-run", "--output", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("kvgate build download ")]
    argv = shlex.split(line)
    assert argv[argv.index("--revision") + 1] == revision and argv[argv.index("--hf-id") + 1] == "acme/model"
