"""`kvgate build engine` / `build repo`: manifest, skip-if-unchanged, failures, the CLI itself."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines.spec import load_bundled_spec, spec_hash
from engines.trtllm.engine_build import EngineBuildError, build_engine, sha256_file
from server.cli import create_cli
from tests.engines.triton.fake_trtllm import write_engine_config

SPEC = "llama-3.1-8b-instruct-fp8kv"


class FakeToolchain:
    """Stands in for quantize.py + trtllm-build: records argv, writes the engine files."""

    def __init__(self, *, fail_step: str | None = None, skip_artifact: str | None = None, paged_context_fmha: bool = True):
        self.commands: list[tuple[str, ...]] = []
        self.fail_step, self.skip_artifact = fail_step, skip_artifact
        self.paged_context_fmha = paged_context_fmha  # False: what builder.py writes on a GPU below SM 89

    def __call__(self, command) -> None:
        self.commands.append(command.argv)
        if command.step == self.fail_step:
            raise EngineBuildError(f"step {command.step} failed with exit code 1")
        if command.step == "trtllm-build":
            out = Path(command.flag("--output_dir"))
            out.mkdir(parents=True, exist_ok=True)
            write_engine_config(out, tokens_per_block=int(command.flag("--tokens_per_block")),
                                paged_context_fmha=self.paged_context_fmha)
            if self.skip_artifact != "rank0.engine":
                (out / "rank0.engine").write_bytes(b"engine-bytes")


def test_build_writes_manifest_and_skips_an_unchanged_spec(tmp_path):
    spec = load_bundled_spec(SPEC)
    tools = FakeToolchain()
    lines: list[str] = []
    first = build_engine(spec, tmp_path, runner=tools, progress=lines.append, trtllm_version="1.2.1")
    assert first.rebuilt and [c[0] for c in tools.commands] == ["python3", "trtllm-build"]
    assert lines[0].startswith("[1/2] quantize: python3 ") and lines[1].startswith("[2/2] trtllm-build: ")
    manifest = json.loads(first.manifest_path.read_text())
    engine_dir = tmp_path / SPEC / "engine"
    assert manifest["spec_hash"] == spec_hash(spec)
    assert manifest["tensorrt_llm_version"] == "1.2.1" and manifest["tensorrt_llm_installed"] == "1.2.1"
    assert manifest["container"] == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert manifest["artifacts"] == {n: sha256_file(engine_dir / n) for n in ("config.json", "rank0.engine")}
    assert manifest["commands"][1][0] == "trtllm-build"

    second = build_engine(spec, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert not second.rebuilt and len(tools.commands) == 2

    (engine_dir / "rank0.engine").write_bytes(b"tampered")
    third = build_engine(spec, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert third.rebuilt and third.reason == "artifact rank0.engine changed"

    changed = spec.model_copy(update={"kv_cache": spec.kv_cache.model_copy(update={"host_cache_size_per_rank": 1 << 30})})
    fourth = build_engine(changed, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert fourth.rebuilt and fourth.reason == "spec changed"
    assert build_engine(changed, tmp_path, runner=tools, force=True).rebuilt


def test_failed_or_incomplete_build_leaves_no_manifest(tmp_path):
    spec = load_bundled_spec(SPEC)
    build_engine(spec, tmp_path, runner=FakeToolchain())
    with pytest.raises(EngineBuildError, match="trtllm-build failed"):
        build_engine(spec, tmp_path, runner=FakeToolchain(fail_step="trtllm-build"), force=True)
    assert not (tmp_path / SPEC / "manifest.json").exists()
    (tmp_path / SPEC / "engine" / "rank0.engine").unlink()
    with pytest.raises(EngineBuildError, match="rank0.engine missing"):
        build_engine(spec, tmp_path, runner=FakeToolchain(skip_artifact="rank0.engine"))
    assert not (tmp_path / SPEC / "manifest.json").exists()


def test_version_mismatch_is_refused(tmp_path):
    with pytest.raises(EngineBuildError, match="pins 1.2.1"):
        build_engine(load_bundled_spec(SPEC), tmp_path, runner=FakeToolchain(), trtllm_version="1.3.0rc1")


def test_cli_dry_run_prints_the_exact_commands(tmp_path):
    result = CliRunner().invoke(create_cli(), ["build", "engine", SPEC, "--dry-run", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    header, memory, quantize, trtllm_build = result.output.strip().splitlines()
    assert header == f"# {SPEC}: would build (no manifest)"
    assert memory == ("# pinned host memory (KV host tier): 32 GiB per rank x 1 rank = 32 GiB per replica "
                      "(34359738368 B per rank, 34359738368 B total)")
    assert shlex.split(quantize)[:2] == ["python3", "/app/examples/quantization/quantize.py"]
    assert shlex.split(trtllm_build)[0] == "trtllm-build"
    assert "--use_paged_context_fmha enable" in trtllm_build
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_of_the_tp8_spec_shows_per_rank_and_total_pinned_host_memory(tmp_path):
    # Every rank builds its own KV cache manager and pins host_cache_size (trtGptModelInflightBatching.cpp,
    # kvCacheManager.cpp calculateFreeMemBytes): the replica pins 8 times the per-rank figure.
    spec = "engines/specs/llama-3.1-70b-instruct-fp8-tp8.yaml"
    result = CliRunner().invoke(create_cli(), ["build", "engine", spec, "--dry-run", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == (
        "# pinned host memory (KV host tier): 32 GiB per rank x 8 ranks = 256 GiB per replica "
        "(34359738368 B per rank, 274877906944 B total)"
    )


def test_an_engine_built_without_paged_context_fmha_gets_no_manifest(tmp_path):
    # tensorrt_llm/builder.py turns use_paged_context_fmha off on GPUs below SM 89 (FP8 KV) with a warning
    # only; the executor would then run the pool without block reuse.
    with pytest.raises(EngineBuildError, match="use_paged_context_fmha=False"):
        build_engine(load_bundled_spec(SPEC), tmp_path, runner=FakeToolchain(paged_context_fmha=False))
    assert not (tmp_path / SPEC / "manifest.json").exists()


def test_cli_errors_are_clean(tmp_path):
    runner = CliRunner()
    result = runner.invoke(create_cli(), ["build", "engine", "reference-smollm2", "--dry-run"])
    assert result.exit_code == 2 and "no TensorRT-LLM engine" in result.output
    result = runner.invoke(create_cli(), ["build", "engine", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "cannot read spec" in result.output
    result = runner.invoke(create_cli(), ["build", "repo", "reference-smollm2", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "not a TensorRT-LLM spec" in result.output


def test_cli_renders_the_repository(tmp_path):
    result = CliRunner().invoke(create_cli(), ["build", "repo", SPEC, "--output", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "repo" / "kvgate_llm" / "config.pbtxt").is_file()
    assert (tmp_path / "repo" / "kvgate_llm" / "1" / "model.py").is_file()
