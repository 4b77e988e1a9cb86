"""Run a :class:`BuildPlan` with a manifest, so that an unchanged spec is never rebuilt.

``<output>/<spec>/manifest.json`` records the spec hash, the TensorRT-LLM version and
container the spec pins, the TensorRT-LLM version actually installed, the exact commands
and a SHA-256 per artifact. A build is skipped when the manifest's spec hash equals the
spec's and every artifact still has its recorded checksum; anything else rebuilds.

The runner is injected (``subprocess`` in the CLI, a double in tests): the commands only
run inside the TensorRT-LLM 1.2 container.

Invariant: the manifest is written last and atomically, only after every command
succeeded, every expected artifact exists and the built ``config.json`` kept paged context
FMHA (``tensorrt_llm/builder.py`` drops it on a GPU below SM 89 with only a warning, and the
pool's block reuse would silently be off) — a half-built or reuse-less engine never looks built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from engines.spec import EngineSpec, spec_hash
from engines.trtllm.build_plan import BuildPlan, Command, build_plan
from engines.trtllm.engine_config import EngineConfigError, check_reuse, read_engine_config

MANIFEST = "manifest.json"
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


def up_to_date(spec: EngineSpec, plan: BuildPlan, manifest_path: Path) -> tuple[bool, str]:
    """(True, why) when the manifest proves the engines were built from this exact spec."""
    if not manifest_path.is_file():
        return False, "no manifest"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False, "manifest unreadable"
    if manifest.get("spec_hash") != spec_hash(spec):
        return False, "spec changed"
    recorded = manifest.get("artifacts", {})
    engine_dir = Path(plan.engine_dir)
    for name in plan.expected_artifacts:
        path = engine_dir / name
        if name not in recorded or not path.is_file():
            return False, f"artifact {name} missing"
        if sha256_file(path) != recorded[name]:
            return False, f"artifact {name} changed"
    return True, "spec hash and artifact checksums match"


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
    fresh, why = up_to_date(spec, plan, manifest_path)
    if fresh and not force:
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
        "tensorrt_llm_version": spec.tensorrt_llm.version,
        "tensorrt_llm_installed": trtllm_version,
        "container": spec.tensorrt_llm.container,
        "kvgate_version": _kvgate_version(),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commands": [list(c.argv) for c in plan.commands],
        "artifacts": {name: sha256_file(engine_dir / name) for name in plan.expected_artifacts},
    }
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, manifest_path)
    progress(f"{spec.name}: built; manifest {manifest_path}")
    return BuildOutcome(plan, manifest_path, rebuilt=True, reason=why)


def _kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"
