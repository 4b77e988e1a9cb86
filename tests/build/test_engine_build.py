"""`kvgate build engine` / `build repo`: manifest, skip-if-unchanged, failures, the CLI itself."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import yaml
from typer.testing import CliRunner

from engines.spec import load_bundled_spec, parse_spec, spec_hash
from engines.trtllm.build_plan import build_plan
from engines.trtllm.engine_build import EngineBuildError, build_engine, sha256_file, up_to_date
from engines.triton.repository import RENDERED_MARKER, render_repository
from server.cli import create_cli
from tests.engines.triton.fake_trtllm import write_engine_config

SPEC = "llama-3.1-8b-instruct-fp8kv"


MAIN = "1111111111111111111111111111111111111111"  # what the fake hub's main branch resolves to
PINNED = "2222222222222222222222222222222222222222"
OTHER = "3333333333333333333333333333333333333333"


class FakeHub:
    """Stands in for ``huggingface_hub``: ``HfApi().model_info`` resolves a revision to a commit (branches and
    tags in ``refs``, any 40-hex commit as itself), ``snapshot_download`` lays the commit out as huggingface_hub's
    cache does (``models--org--name/snapshots/<commit>``) and returns that folder."""

    def __init__(self, cache: Path, refs: dict[str, str] | None = None, *, serve: str | None = None):
        self.cache, self.refs = cache, {"main": MAIN, **(refs or {})}
        self.serve = serve  # a commit snapshot_download returns whatever was asked (a broken mirror)
        self.downloads: list[tuple[str, str | None, tuple[str, ...]]] = []
        self.files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                      "pytorch_model.bin", "consolidated.safetensors", "original/consolidated.00.pth", "tokenizer.json"]
        hub = self

        class HfApi:
            def model_info(self, repo_id, *, revision=None, **_):
                return SimpleNamespace(sha=hub.resolve(revision), siblings=[SimpleNamespace(rfilename=f) for f in hub.files])

        self.HfApi = HfApi

    def resolve(self, revision: str | None) -> str:
        if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
            return revision
        return self.refs[revision or "main"]

    def snapshot_download(self, repo_id, *, revision=None, ignore_patterns=None, **_):
        self.downloads.append((repo_id, revision, tuple(ignore_patterns or ())))
        commit = self.serve or self.resolve(revision)
        folder = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text("{}")
        return str(folder)


class FakeToolchain:
    """Stands in for the builder container: the download step runs the real `kvgate build download` against a
    fake hub; quantize.py + trtllm-build record argv and write the engine files."""

    def __init__(self, *, fail_step: str | None = None, skip_artifact: str | None = None, paged_context_fmha: bool = True,
                 hub: FakeHub | None = None):
        self.commands: list[tuple[str, ...]] = []
        self.fail_step, self.skip_artifact = fail_step, skip_artifact
        self.paged_context_fmha = paged_context_fmha  # False: what builder.py writes on a GPU below SM 89
        self.hub = hub

    def __call__(self, command) -> None:
        self.commands.append(command.argv)
        if command.step == self.fail_step:
            raise EngineBuildError(f"step {command.step} failed with exit code 1")
        if command.step == "download":
            assert command.argv[:3] == ("kvgate", "build", "download")
            hub = self.hub or FakeHub(Path(command.flag("--output")).parent / "hf-cache")
            with mock.patch.dict(sys.modules, {"huggingface_hub": hub}):
                result = CliRunner().invoke(create_cli(), list(command.argv[1:]))
            if result.exit_code != 0:
                raise EngineBuildError(f"step download failed: {result.output or result.exception!r}")
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
    assert first.rebuilt and [c[0] for c in tools.commands] == ["kvgate", "python3", "trtllm-build"]
    assert lines[0].startswith("[1/3] download: kvgate build download ")
    assert lines[1].startswith("[2/3] quantize: python3 ") and lines[2].startswith("[3/3] trtllm-build: ")
    manifest = json.loads(first.manifest_path.read_text())
    engine_dir = tmp_path / SPEC / "engine"
    assert manifest["spec_hash"] == spec_hash(spec)
    assert manifest["tensorrt_llm_version"] == "1.2.1" and manifest["tensorrt_llm_installed"] == "1.2.1"
    assert manifest["container"] == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert manifest["artifacts"] == {n: sha256_file(engine_dir / n) for n in ("config.json", "rank0.engine")}
    assert manifest["commands"][2][0] == "trtllm-build"
    assert manifest["model"] == {"hf_id": "meta-llama/Llama-3.1-8B-Instruct", "revision": spec.model.revision,
                                 "resolved_revision": spec.model.revision}  # the bundled spec pins a commit

    second = build_engine(spec, tmp_path, runner=tools, trtllm_version="1.2.1")
    assert not second.rebuilt and len(tools.commands) == 3

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
    header, memory, download, quantize, trtllm_build = result.output.strip().splitlines()
    assert header == f"# {SPEC}: would build (no manifest)"
    assert memory == ("# pinned host memory (KV host tier): 32 GiB per rank x 1 rank = 32 GiB per replica "
                      "(34359738368 B per rank, 34359738368 B total)")
    assert shlex.split(download)[:3] == ["kvgate", "build", "download"]
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
    argv = manifest["commands"][2]
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


# --- the model's revision: downloaded at it, recorded, part of up-to-date ---------------------

def _model(spec=None, **model):
    data = (spec or load_bundled_spec(SPEC)).model_dump(mode="json")
    data["model"] = {"hf_id": "meta-llama/Llama-3.1-8B-Instruct", "checkpoint_path": None, "tokenizer": None, **model}
    return parse_spec(data)


def test_the_manifest_records_the_commit_the_download_got(tmp_path):
    hub = FakeHub(tmp_path / "hf")
    tools = FakeToolchain(hub=hub)
    unpinned = _model()
    outcome = build_engine(unpinned, tmp_path / "e", runner=tools, trtllm_version="1.2.1")
    manifest = json.loads(outcome.manifest_path.read_text())
    assert manifest["model"] == {"hf_id": "meta-llama/Llama-3.1-8B-Instruct", "revision": None, "resolved_revision": MAIN}
    # resolved first, then that exact commit downloaded; Meta's original/*.pth and the weights' twins are left out
    [(repo, asked, ignored)] = hub.downloads
    assert (repo, asked) == ("meta-llama/Llama-3.1-8B-Instruct", MAIN)
    assert {"original/*", "*.pth", "*.bin", "consolidated*.safetensors"} <= set(ignored)
    link = Path(outcome.plan.commands[1].flag("--model_dir"))  # what quantize.py reads
    assert link.is_symlink() and link.resolve().name == MAIN and link.resolve().parent.name == "snapshots"

    pinned = _model(revision=PINNED)
    outcome = build_engine(pinned, tmp_path / "e", runner=FakeToolchain(hub=hub), trtllm_version="1.2.1")
    assert outcome.rebuilt
    assert json.loads(outcome.manifest_path.read_text())["model"]["resolved_revision"] == PINNED
    assert hub.downloads[-1][1] == PINNED and link.resolve().name == PINNED


def test_a_download_that_is_not_the_pinned_commit_leaves_no_manifest(tmp_path):
    hub = FakeHub(tmp_path / "hf", serve=OTHER)
    with pytest.raises(EngineBuildError, match=f"asked for {PINNED}.*got {OTHER}"):
        build_engine(_model(revision=PINNED), tmp_path / "e", runner=FakeToolchain(hub=hub), trtllm_version="1.2.1")
    assert not (tmp_path / "e" / SPEC / "manifest.json").exists()


def test_only_a_revision_change_makes_the_engine_out_of_date(tmp_path):
    hub = FakeHub(tmp_path / "hf", {"v1": PINNED})
    build_engine(_model(revision=PINNED), tmp_path, runner=FakeToolchain(hub=hub), trtllm_version="1.2.1")
    assert _fresh(_model(revision=PINNED), tmp_path, trtllm_version="1.2.1")[0]
    fresh, why = _fresh(_model(revision=OTHER), tmp_path, trtllm_version="1.2.1")
    assert not fresh and why == f"model revision changed: engine built from {PINNED}, the spec pins {OTHER}"
    # a tag naming the same commit: the same engine, when the tag can be resolved
    assert _fresh(_model(revision="v1"), tmp_path, trtllm_version="1.2.1", resolve_revision=lambda repo, rev: hub.resolve(rev))[0]
    fresh, why = _fresh(_model(revision="v1"), tmp_path, trtllm_version="1.2.1")  # and when it cannot: rebuild
    assert not fresh and why.startswith("model revision changed: engine built from ") and "'v1'" in why
    outcome = build_engine(_model(revision=OTHER), tmp_path, runner=FakeToolchain(hub=hub), trtllm_version="1.2.1")
    assert outcome.rebuilt and outcome.reason.startswith("model revision changed")


def test_pinning_the_commit_an_unpinned_build_recorded_keeps_the_engine(tmp_path):
    build_engine(_model(), tmp_path, runner=FakeToolchain(hub=FakeHub(tmp_path / "hf")), trtllm_version="1.2.1")
    tools = FakeToolchain()
    outcome = build_engine(_model(revision=MAIN), tmp_path, runner=tools, trtllm_version="1.2.1")
    assert not outcome.rebuilt and tools.commands == [], outcome.reason


def test_an_unpinned_engine_is_out_of_date_when_its_branch_moved(tmp_path):
    spec = _model()
    build_engine(spec, tmp_path, runner=FakeToolchain(hub=FakeHub(tmp_path / "hf")), trtllm_version="1.2.1")
    assert _fresh(spec, tmp_path, trtllm_version="1.2.1", resolve_revision=lambda repo, rev: MAIN)[0]
    fresh, why = _fresh(spec, tmp_path, trtllm_version="1.2.1", resolve_revision=lambda repo, rev: OTHER)
    assert not fresh and why == (f"model changed upstream: engine built from meta-llama/Llama-3.1-8B-Instruct@{MAIN}, "
                                 f"main now resolves to {OTHER}")

    def offline(repo, rev):
        raise OSError("offline")

    fresh, why = _fresh(spec, tmp_path, trtllm_version="1.2.1", resolve_revision=offline)
    assert fresh and "not checked upstream (offline)" in why  # an air-gapped builder keeps its engine
    outcome = build_engine(spec, tmp_path, runner=FakeToolchain(hub=FakeHub(tmp_path / "hf", {"main": OTHER})),
                           trtllm_version="1.2.1", resolve_revision=lambda repo, rev: OTHER)
    assert outcome.rebuilt
    assert json.loads(outcome.manifest_path.read_text())["model"]["resolved_revision"] == OTHER


def test_the_tokenizer_is_saved_at_the_model_revision(tmp_path):
    from engines.triton.repository import save_spec_tokenizer

    calls: list[tuple[str, dict]] = []

    class Tok:
        def save_pretrained(self, directory):
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / "tokenizer.json").write_text("{}")

    def load(source, **kwargs):
        calls.append((source, kwargs))
        return Tok()

    def save(spec) -> str:
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
        return save_spec_tokenizer(str(path), str(tmp_path / "engines"), load=load)

    save(_model(revision=PINNED))
    assert calls == [("meta-llama/Llama-3.1-8B-Instruct", {"revision": PINNED})]
    assert "already in" in save(_model(revision=PINNED)) and len(calls) == 1
    save(_model(revision=OTHER))  # another revision: saved again
    assert calls[-1] == ("meta-llama/Llama-3.1-8B-Instruct", {"revision": OTHER})
    # unpinned: the commit the engine build recorded, so weights and tokenizer come from one commit
    unpinned = _model()
    build_engine(unpinned, tmp_path / "engines", runner=FakeToolchain(hub=FakeHub(tmp_path / "hf")), trtllm_version="1.2.1")
    save(unpinned)
    assert calls[-1] == ("meta-llama/Llama-3.1-8B-Instruct", {"revision": MAIN})
    # a tokenizer from another repo is not pinned by the model's revision
    save(_model(revision=PINNED, tokenizer="acme/tok"))
    assert calls[-1] == ("acme/tok", {})


def test_offline_the_download_takes_the_commit_from_the_cache_and_the_hub_check_says_it_cannot(tmp_path, monkeypatch):
    from engines.trtllm.model_download import DownloadError, download_hf_model, hub_commit

    hub = FakeHub(tmp_path / "hf", {"v1": PINNED})
    assert hub_commit("acme/m", "v1", hub=hub) == PINNED and hub_commit("acme/m", None, hub=hub) == MAIN

    def no_api():
        raise AssertionError("offline: the Hub API must not be called")

    hub.HfApi = no_api
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # huggingface_hub then answers from its cache's refs/
    record = download_hf_model("acme/m", "v1", tmp_path / "src", hub=hub)
    assert record["resolved_revision"] == PINNED and hub.downloads[-1][:2] == ("acme/m", "v1")
    assert json.loads((tmp_path / "src" / "source.json").read_text())["resolved_revision"] == PINNED
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        hub_commit("acme/m", "v1", hub=hub)


def test_the_dry_run_warns_that_an_unpinned_model_is_not_reproducible(tmp_path):
    spec = "engines/specs/llama-3.1-70b-instruct-fp8-tp8.yaml"  # bundled unpinned
    result = CliRunner().invoke(create_cli(), ["build", "engine", spec, "--dry-run", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    [warning] = [line for line in result.output.splitlines() if line.startswith("# warning: ")]
    assert "'meta-llama/Llama-3.1-70B-Instruct' has no revision" in warning and "not reproducible" in warning
    pinned = CliRunner().invoke(create_cli(), ["build", "engine", SPEC, "--dry-run", "--output", str(tmp_path)])
    assert "# warning:" not in pinned.output
