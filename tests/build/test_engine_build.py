"""`kvgate build engine` / `build repo`: manifest, skip-if-unchanged, failures, the CLI itself."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines.spec import load_bundled_spec, spec_hash
from engines.trtllm.build_plan import build_plan
from engines.trtllm.engine_build import EngineBuildError, build_engine, sha256_file, up_to_date
from engines.triton.repository import RENDERED_MARKER, render_repository
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

    changed = spec.model_copy(update={"build": spec.build.model_copy(update={"max_batch_size": 32})})
    fourth = build_engine(changed, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert fourth.rebuilt and fourth.reason == "build commands changed (trtllm-build: --max_batch_size 64 -> 32)"
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


def _built(tmp_path, spec=None):
    spec = spec or load_bundled_spec(SPEC)
    outcome = build_engine(spec, tmp_path, runner=FakeToolchain(), trtllm_version="1.2.1")
    return spec, outcome.manifest_path


def _fresh(spec, root, **kwargs):
    return up_to_date(spec, build_plan(spec, output_dir=str(root)), root / spec.name / "manifest.json", **kwargs)


def test_an_engine_built_by_another_command_line_or_trtllm_is_not_up_to_date(tmp_path):
    spec, manifest_path = _built(tmp_path)
    assert _fresh(spec, tmp_path, trtllm_version="1.2.1")[0]
    assert _fresh(spec, tmp_path, trtllm_version=None)[0]  # unknown installed version: not compared
    assert _fresh(spec, tmp_path, trtllm_version="1.2.2") == (
        False, "TensorRT-LLM changed: engine built with 1.2.1, 1.2.2 installed")
    # An earlier kvgate ran trtllm-build with another argument: same spec, another engine.
    manifest = json.loads(manifest_path.read_text())
    argv = manifest["commands"][1]
    argv[argv.index("--max_beam_width") + 1] = "4"
    manifest_path.write_text(json.dumps(manifest))
    assert _fresh(spec, tmp_path, trtllm_version="1.2.1") == (
        False, "build commands changed (trtllm-build: --max_beam_width 4 -> 1)")
    outcome = build_engine(spec, tmp_path, runner=FakeToolchain(), trtllm_version="1.2.1")
    assert outcome.rebuilt and _fresh(spec, tmp_path, trtllm_version="1.2.1")[0]


def test_the_same_engine_under_another_output_directory_is_up_to_date(tmp_path):
    spec, _ = _built(tmp_path / "a")
    (tmp_path / "a").rename(tmp_path / "b")  # the volume mounted elsewhere: -o differs, argv paths too
    fresh, why = _fresh(spec, tmp_path / "b", trtllm_version="1.2.1")
    assert fresh, why


@pytest.mark.parametrize("change", ["description", "free_gpu_memory_fraction", "host_cache_size_per_rank", "triton"])
def test_a_spec_change_the_build_does_not_consume_keeps_the_engine(tmp_path, change):
    spec, manifest_path = _built(tmp_path)
    changed = {
        "description": lambda s: s.model_copy(update={"description": "typo fixed"}),
        "free_gpu_memory_fraction": lambda s: s.model_copy(
            update={"kv_cache": s.kv_cache.model_copy(update={"free_gpu_memory_fraction": 0.8})}),
        "host_cache_size_per_rank": lambda s: s.model_copy(
            update={"kv_cache": s.kv_cache.model_copy(update={"host_cache_size_per_rank": 1 << 30})}),
        "triton": lambda s: s.model_copy(update={"triton": s.triton.model_copy(update={"response_poll_ms": 9})}),
    }[change](spec)
    assert spec_hash(changed) != spec_hash(spec)
    assert _fresh(changed, tmp_path, trtllm_version="1.2.1")[0]
    tools = FakeToolchain()
    outcome = build_engine(changed, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert not outcome.rebuilt and tools.commands == []
    # The engine pods wait for their spec's hash in the manifest (Helm's waitForEngineScript).
    assert json.loads(manifest_path.read_text())["spec_hash"] == spec_hash(changed)
    assert "manifest now carries spec hash" in outcome.reason


def test_a_manifest_from_an_earlier_kvgate_is_trusted_only_for_the_same_spec(tmp_path):
    spec, manifest_path = _built(tmp_path)
    manifest = json.loads(manifest_path.read_text())
    del manifest["engine_fingerprint"]  # what kvgate wrote before the fingerprint existed
    manifest_path.write_text(json.dumps(manifest))
    outcome = build_engine(spec, tmp_path, runner=FakeToolchain(), trtllm_version="1.2.1")
    assert not outcome.rebuilt and outcome.reason.startswith("spec hash (manifest from an earlier kvgate)")
    assert "engine_fingerprint" in json.loads(manifest_path.read_text())  # upgraded in place

    manifest_path.write_text(json.dumps(manifest))  # the earlier kvgate's manifest again
    described = spec.model_copy(update={"description": "typo fixed"})
    fresh, why = _fresh(described, tmp_path, trtllm_version="1.2.1")
    assert not fresh and "earlier kvgate" in why and why.endswith("rebuilding")


def test_a_spec_that_now_wants_block_reuse_rechecks_the_built_engine(tmp_path):
    spec = load_bundled_spec(SPEC)
    no_reuse = spec.model_copy(update={"kv_cache": spec.kv_cache.model_copy(update={"enable_block_reuse": False})})
    build_engine(no_reuse, tmp_path, runner=FakeToolchain(paged_context_fmha=False), trtllm_version="1.2.1")
    fresh, why = _fresh(spec, tmp_path, trtllm_version="1.2.1")
    assert not fresh and why.startswith("built engine does not serve this spec") and "paged context FMHA" in why


def test_a_second_render_removes_the_models_kvgate_rendered_before_and_nothing_else(tmp_path):
    # Triton loads every model folder in the repository: a folder left from an earlier render would
    # start a second executor on the same GPUs.
    first = load_bundled_spec(SPEC)
    other = first.triton.model_copy(update={"model_name": "kvgate_other"})
    second = first.model_copy(update={"name": "other-8b", "triton": other})
    repo = tmp_path / "models"
    render_repository([first], repo, engines_root="/engines")
    assert (repo / "kvgate_llm" / RENDERED_MARKER).is_file()
    foreign = repo / "operator_model"
    (foreign / "1").mkdir(parents=True)
    (foreign / "config.pbtxt").write_text('backend: "python"\n')
    render_repository([second], repo, engines_root="/engines")
    assert sorted(p.name for p in repo.iterdir()) == ["kvgate_other", "operator_model"]
    assert (foreign / "config.pbtxt").read_text() == 'backend: "python"\n'
    render_repository([first, second], repo, engines_root="/engines")
    assert sorted(p.name for p in repo.iterdir()) == ["kvgate_llm", "kvgate_other", "operator_model"]
