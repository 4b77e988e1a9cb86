"""Run a :class:`BuildPlan` with a manifest, so that an unchanged engine is never rebuilt.

``<output>/<spec>/manifest.json`` records the spec hash, the engine fingerprint, the
TensorRT-LLM version and container the spec pins, the TensorRT-LLM version actually
installed, the exact commands and a SHA-256 per artifact.

A build is skipped (:func:`up_to_date`) when the installed TensorRT-LLM is the one that
built the engine, the recorded commands equal the plan's (directories aside), the
*engine fingerprint* matches and every artifact still has its recorded checksum. The
fingerprint (:func:`engine_fingerprint`) covers only what the build consumes — the
plan's commands with the output directories replaced by placeholders, the artifact list
and the TensorRT-LLM pin — not the whole spec, so a new ``description`` or a setting
rendered only into config.pbtxt (``kv_cache.free_gpu_memory_fraction``, host tier size,
Triton options) keeps an engine that takes hours to rebuild. Such a skip rewrites the
manifest with the new spec hash, because the engine pods wait for the manifest to carry
their spec's hash (Helm's ``kvgate.waitForEngineScript``).

The runner is injected (``subprocess`` in the CLI, a double in tests): the commands only
run inside the TensorRT-LLM 1.2 container.

Invariant: the manifest is written last and atomically, only after every command
succeeded, every expected artifact exists and the built ``config.json`` kept paged context
FMHA (``tensorrt_llm/builder.py`` drops it on a GPU below SM 89 with only a warning, and the
pool's block reuse would silently be off) — a half-built or reuse-less engine never looks built.
A skipped build re-checks that ``config.json`` against the current spec for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from engines.spec import EngineSpec, spec_hash
from engines.trtllm.build_plan import BuildPlan, BuildPlanError, Command, build_plan
from engines.trtllm.engine_config import EngineConfigError, check_reuse, read_engine_config

MANIFEST = "manifest.json"
# Flags whose value is a directory under --output: compared as placeholders, so the same engine
# found under another mount point (a different -o) still counts as built.
_DIRECTORY_FLAGS = frozenset({"--output_dir", "--checkpoint_dir"})
_DETECT = object()  # up_to_date's default: ask the installed tensorrt_llm package
Runner = Callable[[Command], None]
Progress = Callable[[str], None]


class EngineBuildError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class BuildOutcome:
    plan: BuildPlan
    manifest_path: Path
    rebuilt: bool
    reason: str


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def installed_trtllm_version() -> str | None:
    try:
        return metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError:
        return None


def normalized_commands(commands: Iterable[Sequence[str]]) -> list[list[str]]:
    """Each argv with the value of every directory flag replaced by ``<flag name>``."""
    out = []
    for argv in commands:
        tokens = list(argv)
        for i in range(len(tokens) - 1):
            if tokens[i] in _DIRECTORY_FLAGS:
                tokens[i + 1] = f"<{tokens[i].lstrip('-')}>"
        out.append(tokens)
    return out


def engine_fingerprint(spec: EngineSpec, plan: BuildPlan) -> str:
    """SHA-256 of what the build consumes: equal fingerprints ⇒ the same trtllm-build / quantize.py inputs.

    :func:`build_plan` is a pure function of the spec, so its normalized commands carry every spec
    field that reaches quantize.py or trtllm-build; the artifact list and the TensorRT-LLM pin (engines
    are tied to a release) complete it. The container name is left out: a mirror of the same image
    does not change the engine, and the installed TensorRT-LLM version is compared on its own.
    """
    assert spec.tensorrt_llm is not None  # build_plan refused other backends
    inputs = {
        "commands": normalized_commands(c.argv for c in plan.commands),
        "expected_artifacts": list(plan.expected_artifacts),
        "tensorrt_llm_version": spec.tensorrt_llm.version,
    }
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _commands_difference(recorded: list[list[str]], planned: list[list[str]], plan: BuildPlan) -> str:
    """Say how the recorded commands differ from the plan's: the first differing step and its flags."""
    if len(recorded) != len(planned):
        return f"{len(recorded)} recorded steps, the plan has {len(planned)}"
    for command, old, new in zip(plan.commands, recorded, planned, strict=True):
        if old == new:
            continue
        try:
            before, after = Command(command.step, tuple(old)).flags(), Command(command.step, tuple(new)).flags()
        except BuildPlanError:
            before, after = {}, {}
        changed = [
            f"{flag} {before.get(flag, '(absent)')} -> {after.get(flag, '(absent)')}"
            for flag in sorted(before.keys() | after.keys())
            if before.get(flag) != after.get(flag)
        ]
        return f"{command.step}: {', '.join(changed) if changed else 'argv differs'}"
    return "argv differs"


@dataclass(frozen=True, slots=True)
class _Check:
    fresh: bool
    reason: str
    manifest: dict | None = None  # the manifest read, when the engine is up to date


def _check(spec: EngineSpec, plan: BuildPlan, manifest_path: Path, installed: str | None) -> _Check:
    if not manifest_path.is_file():
        return _Check(False, "no manifest")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return _Check(False, "manifest unreadable")
    if not isinstance(manifest, dict):
        return _Check(False, "manifest unreadable")
    # None: the caller does not know what is installed (outside the container); the build itself
    # refuses a TensorRT-LLM other than the spec's pin.
    built_with = manifest.get("tensorrt_llm_installed")
    if installed is not None and built_with != installed:
        return _Check(False, f"TensorRT-LLM changed: engine built with {built_with or 'an unknown version'}, "
                             f"{installed} installed")
    recorded = manifest.get("commands")
    if not isinstance(recorded, list) or not all(isinstance(c, list) for c in recorded):
        return _Check(False, "manifest records no build commands")
    built, planned = normalized_commands(recorded), normalized_commands(c.argv for c in plan.commands)
    if built != planned:
        return _Check(False, f"build commands changed ({_commands_difference(built, planned, plan)})")
    basis = "engine fingerprint"
    if "engine_fingerprint" in manifest:
        if manifest["engine_fingerprint"] != engine_fingerprint(spec, plan):
            return _Check(False, "engine inputs changed (engine fingerprint differs)")
    elif manifest.get("spec_hash") != spec_hash(spec):
        # A manifest from an earlier kvgate has no fingerprint. Its spec hash covers the whole spec
        # (a superset of the engine's inputs), so a match still proves the same engine; a mismatch
        # cannot tell a description edit from a new max_seq_len, so it rebuilds.
        return _Check(False, "spec changed since an earlier kvgate built this engine (its manifest has no "
                             "engine fingerprint); rebuilding")
    else:
        basis = "spec hash (manifest from an earlier kvgate)"
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, dict):
        return _Check(False, "manifest records no artifacts")
    engine_dir = Path(plan.engine_dir)
    for name in plan.expected_artifacts:
        path = engine_dir / name
        if name not in artifacts or not path.is_file():
            return _Check(False, f"artifact {name} missing")
        if sha256_file(path) != artifacts[name]:
            return _Check(False, f"artifact {name} changed")
    try:  # the engine may predate a spec that now enables block reuse
        check_reuse(read_engine_config(engine_dir), enable_block_reuse=spec.kv_cache.enable_block_reuse,
                    tokens_per_block=spec.build.tokens_per_block)
    except EngineConfigError as exc:
        return _Check(False, f"built engine does not serve this spec: {exc}")
    return _Check(True, f"{basis}, build commands, TensorRT-LLM version and artifact checksums match", manifest)


def up_to_date(
    spec: EngineSpec, plan: BuildPlan, manifest_path: Path, *, trtllm_version: str | None | object = _DETECT
) -> tuple[bool, str]:
    """(True, why) when the manifest proves the engines were built from this spec's engine inputs.

    ``trtllm_version`` is the installed TensorRT-LLM (None: unknown, not compared); by default it is
    read from the installed ``tensorrt_llm`` package. When False, ``why`` names what differs.
    """
    installed = installed_trtllm_version() if trtllm_version is _DETECT else trtllm_version
    assert installed is None or isinstance(installed, str)
    check = _check(spec, plan, manifest_path, installed)
    return check.fresh, check.reason


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"


def host_memory_summary(spec: EngineSpec) -> str:
    """Pinned host memory of the KV host tier: per rank and for the replica (every rank pins its own)."""
    ranks = spec.build.world_size
    per_rank, total = spec.pinned_host_bytes_per_rank(), spec.pinned_host_bytes_total()
    return (
        f"pinned host memory (KV host tier): {_gib(per_rank)} per rank x {ranks} rank{'s' if ranks != 1 else ''} "
        f"= {_gib(total)} per replica ({per_rank} B per rank, {total} B total)"
    )


def subprocess_runner(command: Command) -> None:
    """Run one command in the foreground, its output going to the terminal."""
    if shutil.which(command.argv[0]) is None:
        raise EngineBuildError(
            f"{command.argv[0]!r} not found: `kvgate build engine` runs inside the TensorRT-LLM 1.2 container "
            "(docker compose --profile gpu run --rm engine-builder ...)"
        )
    completed = subprocess.run(list(command.argv), check=False)
    if completed.returncode != 0:
        raise EngineBuildError(f"step {command.step} failed with exit code {completed.returncode}")


def build_engine(
    spec: EngineSpec,
    output_dir: str | Path,
    *,
    runner: Runner = subprocess_runner,
    progress: Progress = lambda _: None,
    force: bool = False,
    trtllm_version: str | None = None,
) -> BuildOutcome:
    plan = build_plan(spec, output_dir=str(output_dir))
    root = Path(output_dir) / spec.name
    manifest_path = root / MANIFEST
    check = _check(spec, plan, manifest_path, trtllm_version)
    why = check.reason
    if check.fresh and check.manifest is not None and not force:
        current = {"spec_name": spec.name, "spec_hash": spec_hash(spec),
                   "engine_fingerprint": engine_fingerprint(spec, plan)}
        if any(check.manifest.get(k) != v for k, v in current.items()):
            # Same engine, another spec text (description, serving settings) or a manifest from an
            # earlier kvgate: the engine pods wait for their spec's hash in this manifest.
            _write_manifest(manifest_path, {**check.manifest, **current})
            why += f"; manifest now carries spec hash {current['spec_hash'][:12]}"
        progress(f"{spec.name}: up to date ({why}); not rebuilt")
        return BuildOutcome(plan, manifest_path, rebuilt=False, reason=why)
    assert spec.tensorrt_llm is not None  # build_plan refused other backends
    if trtllm_version is not None and trtllm_version != spec.tensorrt_llm.version:
        raise EngineBuildError(
            f"installed TensorRT-LLM is {trtllm_version} but spec {spec.name} pins {spec.tensorrt_llm.version}: "
            "engines are tied to the exact release that serves them"
        )
    root.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # a failed rebuild must not leave the old manifest claiming success
    total = len(plan.commands)
    for index, command in enumerate(plan.commands, start=1):
        progress(f"[{index}/{total}] {command.step}: {' '.join(command.argv)}")
        runner(command)
    engine_dir = Path(plan.engine_dir)
    missing = [name for name in plan.expected_artifacts if not (engine_dir / name).is_file()]
    if missing:
        raise EngineBuildError(f"build finished but {', '.join(missing)} missing under {engine_dir}")
    try:
        check_reuse(read_engine_config(engine_dir), enable_block_reuse=spec.kv_cache.enable_block_reuse,
                    tokens_per_block=spec.build.tokens_per_block)
    except EngineConfigError as exc:
        raise EngineBuildError(f"built engine refused: {exc}") from exc
    progress(f"checksumming {len(plan.expected_artifacts)} artifacts")
    manifest = {
        "spec_name": spec.name,
        "spec_hash": spec_hash(spec),
        "engine_fingerprint": engine_fingerprint(spec, plan),
        "tensorrt_llm_version": spec.tensorrt_llm.version,
        "tensorrt_llm_installed": trtllm_version,
        "container": spec.tensorrt_llm.container,
        "kvgate_version": _kvgate_version(),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commands": [list(c.argv) for c in plan.commands],
        "artifacts": {name: sha256_file(engine_dir / name) for name in plan.expected_artifacts},
    }
    _write_manifest(manifest_path, manifest)
    progress(f"{spec.name}: built; manifest {manifest_path}")
    return BuildOutcome(plan, manifest_path, rebuilt=True, reason=why)


def _kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"
