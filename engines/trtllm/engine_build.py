"""Run a :class:`BuildPlan` with a manifest, so that an unchanged engine is never rebuilt.

``<output>/<spec>/manifest.json`` records the spec hash, the engine fingerprint, the
TensorRT-LLM version and container the spec pins, the TensorRT-LLM version actually
installed, the exact commands and a SHA-256 per artifact.

A build is skipped (:func:`up_to_date`) when the installed TensorRT-LLM is the one that
built the engine, the recorded commands equal the plan's (directories aside), the
*engine fingerprint* matches, the model commit matches and every artifact still has its
recorded checksum. The
fingerprint (:func:`engine_fingerprint`) covers only what the build consumes — the
plan's commands with the output directories replaced by placeholders, the artifact list
and the TensorRT-LLM pin — not the whole spec, so a new ``description`` or a setting
rendered only into config.pbtxt (``kv_cache.free_gpu_memory_fraction``, host tier size,
Triton options) keeps an engine that takes hours to rebuild. Such a skip rewrites the
manifest with the new spec hash, because the engine pods wait for the manifest to carry
their spec's hash (Helm's ``kvgate.waitForEngineScript``).

The model commit: a ``model.hf_id`` spec is downloaded by the plan's first step
(:func:`download_hf_model`), which resolves ``model.revision`` (unset: the repo's default
branch, ``main``) to a commit and records it; the manifest keeps it as ``model.resolved_revision``.
The requested revision is left out of the command comparison and the fingerprint and compared
as a commit instead: a spec pinned to another commit rebuilds, pinning the commit an unpinned
build recorded keeps the engine, and a branch or tag (or no revision) is re-resolved when the
caller passes ``resolve_revision`` (the CLI asks the Hub, :func:`hub_commit`) — a branch that
moved rebuilds; when it cannot be resolved (offline), an unchanged request keeps the engine and
the reason says the model was not checked upstream, while a changed one rebuilds.

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

from engines.spec import COMMIT_SHA, EngineSpec, spec_hash
from engines.trtllm.build_plan import SOURCE_RECORD, BuildPlan, BuildPlanError, Command, build_plan
from engines.trtllm.model_download import DEFAULT_BRANCH
from engines.trtllm.engine_config import EngineConfigError, check_reuse, read_engine_config

MANIFEST = "manifest.json"
# Flags whose value is a directory under --output: compared as placeholders, so the same engine
# found under another mount point (a different -o) still counts as built; so is any other argument
# naming a path under one of them (quantize.py's --model_dir under the download's --output).
_DIRECTORY_FLAGS = frozenset({"--output_dir", "--checkpoint_dir", "--output"})
# The download step's requested revision: compared as the commit it resolved to, not as text.
_REVISION_FLAG = "--revision"
_DETECT = object()  # up_to_date's default: ask the installed tensorrt_llm package
Runner = Callable[[Command], None]
Progress = Callable[[str], None]
# (hf_id, revision or None) -> the commit that revision names now; raises when it cannot tell.
Resolver = Callable[[str, str | None], str]


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
    """Each argv with the value of every directory flag replaced by ``<flag name>``, any other argument
    under such a directory written relative to its placeholder, and ``--revision`` left out (the model
    commit is compared on its own, :func:`_model_difference`)."""
    argvs = [list(argv) for argv in commands]
    directories: dict[str, str] = {}
    for tokens in argvs:
        for flag, value in zip(tokens, tokens[1:], strict=False):
            if flag in _DIRECTORY_FLAGS:
                directories.setdefault(value.rstrip("/"), f"<{flag.lstrip('-')}>")
    under = sorted(directories.items(), key=lambda item: -len(item[0]))  # the deepest directory wins
    out = []
    for tokens in argvs:
        normalized: list[str] = []
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == _REVISION_FLAG and i + 1 < len(tokens):
                i += 2
                continue
            if token in _DIRECTORY_FLAGS and i + 1 < len(tokens):
                normalized += [token, f"<{token.lstrip('-')}>"]
                i += 2
                continue
            for directory, placeholder in under:
                if token.startswith(directory + "/"):
                    token = placeholder + token[len(directory):]
                    break
            normalized.append(token)
            i += 1
        out.append(normalized)
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


def _model_difference(spec: EngineSpec, manifest: dict, resolve: Resolver | None) -> tuple[str | None, str]:
    """(why the engine's model commit is not the spec's, or None; a note for the up-to-date reason)."""
    model = spec.model
    if model.hf_id is None:
        return None, ""
    recorded = manifest.get("model")
    built = recorded.get("resolved_revision") if isinstance(recorded, dict) else None
    if not isinstance(built, str) or not COMMIT_SHA.fullmatch(built) or recorded.get("hf_id") != model.hf_id:
        return "manifest records no model commit", ""
    if model.pinned_commit is not None:
        if model.pinned_commit != built:
            return f"model revision changed: engine built from {built}, the spec pins {model.pinned_commit}", ""
        return None, ""
    label = model.revision or DEFAULT_BRANCH
    same_request = recorded.get("revision") == model.revision
    now, why_not = None, "the Hub was not asked"
    if resolve is not None:
        try:
            now = resolve(model.hf_id, model.revision)
        except Exception as exc:  # noqa: BLE001 - offline, no token, hub errors: any of them means "cannot tell"
            why_not = str(exc) or type(exc).__name__
    if now is not None:
        if now == built:
            return None, f"; model {model.hf_id} {label} still at {built[:12]}"
        if same_request:
            return f"model changed upstream: engine built from {model.hf_id}@{built}, {label} now resolves to {now}", ""
        return f"model revision changed: engine built from {built}, {label!r} resolves to {now}", ""
    if not same_request:
        asked = recorded.get("revision")
        return (f"model revision changed: engine built from {built} "
                f"({repr(asked) if asked else 'the default branch'}), the spec asks for {label!r} ({why_not})"), ""
    return None, f"; model {model.hf_id}@{built[:12]} ({label}) not checked upstream ({why_not})"


def _check(spec: EngineSpec, plan: BuildPlan, manifest_path: Path, installed: str | None,
           resolve: Resolver | None = None) -> _Check:
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
    changed, note = _model_difference(spec, manifest, resolve)
    if changed is not None:
        return _Check(False, changed)
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
    model = " model commit," if spec.model.hf_id is not None else ""
    return _Check(True, f"{basis}, build commands,{model} TensorRT-LLM version and artifact checksums match{note}",
                  manifest)


def up_to_date(
    spec: EngineSpec, plan: BuildPlan, manifest_path: Path, *, trtllm_version: str | None | object = _DETECT,
    resolve_revision: Resolver | None = None,
) -> tuple[bool, str]:
    """(True, why) when the manifest proves the engines were built from this spec's engine inputs.

    ``trtllm_version`` is the installed TensorRT-LLM (None: unknown, not compared); by default it is
    read from the installed ``tensorrt_llm`` package. ``resolve_revision`` (e.g. :func:`hub_commit`)
    says which commit an unpinned or branch/tag ``model.revision`` names now; without it (or when it
    fails) that is not checked. When False, ``why`` names what differs.
    """
    installed = installed_trtllm_version() if trtllm_version is _DETECT else trtllm_version
    assert installed is None or isinstance(installed, str)
    check = _check(spec, plan, manifest_path, installed, resolve_revision)
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
    resolve_revision: Resolver | None = None,
) -> BuildOutcome:
    plan = build_plan(spec, output_dir=str(output_dir))
    root = Path(output_dir) / spec.name
    manifest_path = root / MANIFEST
    check = _check(spec, plan, manifest_path, trtllm_version, resolve_revision)
    why = check.reason
    if check.fresh and check.manifest is not None and not force:
        current = {"spec_name": spec.name, "spec_hash": spec_hash(spec),
                   "engine_fingerprint": engine_fingerprint(spec, plan)}
        if spec.model.hf_id is not None:  # the same commit, now asked for as the spec asks
            current["model"] = {**check.manifest["model"], "revision": spec.model.revision}
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
    if plan.model_record is not None:  # nor an earlier download's record stand for this one
        Path(plan.model_record).unlink(missing_ok=True)
    total = len(plan.commands)
    for index, command in enumerate(plan.commands, start=1):
        progress(f"[{index}/{total}] {command.step}: {' '.join(command.argv)}")
        runner(command)
    model = _downloaded_model(spec, plan)
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
        "model": model,
    }
    _write_manifest(manifest_path, manifest)
    progress(f"{spec.name}: built; manifest {manifest_path}")
    return BuildOutcome(plan, manifest_path, rebuilt=True, reason=why)


def _downloaded_model(spec: EngineSpec, plan: BuildPlan) -> dict[str, object]:
    """What the manifest records of the model: the commit the download step got (checked against a pin)."""
    if spec.model.hf_id is None or plan.model_record is None:
        return {"checkpoint_path": spec.model.checkpoint_path}
    try:
        record = json.loads(Path(plan.model_record).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineBuildError(f"the download step left no readable record at {plan.model_record}: {exc}") from exc
    got = record.get("resolved_revision") if isinstance(record, dict) else None
    if not isinstance(got, str) or not COMMIT_SHA.fullmatch(got) or record.get("hf_id") != spec.model.hf_id:
        raise EngineBuildError(f"the download record {plan.model_record} names no commit of {spec.model.hf_id}")
    pinned = spec.model.pinned_commit
    if pinned is not None and got != pinned:
        raise EngineBuildError(f"model download of {spec.model.hf_id}: asked for {pinned}, got {got}")
    return {"hf_id": spec.model.hf_id, "revision": spec.model.revision, "resolved_revision": got}


def recorded_model_revision(spec: EngineSpec, engines_root: str | Path) -> str | None:
    """The commit of ``model.hf_id`` the engine under ``engines_root`` was built from, when its manifest
    carries this spec's hash (None otherwise: no build yet, another spec, a local checkpoint)."""
    try:
        manifest = json.loads((Path(engines_root) / spec.name / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = manifest.get("model") if isinstance(manifest, dict) else None
    if not isinstance(model, dict) or model.get("hf_id") != spec.model.hf_id:
        return None
    if manifest.get("spec_hash") != spec_hash(spec):  # the builder rewrites it on every run, skipped or not
        return None
    got = model.get("resolved_revision")
    return got if isinstance(got, str) and COMMIT_SHA.fullmatch(got) else None


def _kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"
