"""The engine build's download step: a Hugging Face model at one commit, into the Hub's cache.

``kvgate build download`` (the first command of a spec with ``hf_id``, ``build_plan``) runs
:func:`download_hf_model`: the spec's ``revision`` (a commit, a branch or a tag; None: the
default branch) is resolved to a commit, that commit is downloaded and linked at
``<output>/<hf_id>``, and ``<output>/source.json`` records it, so the engine's manifest
names the weights it was built from. quantize.py reads the link: it cannot take a revision
itself (``examples/quantization/quantize.py`` has no such option; ``quantize_by_modelopt.py``
calls ``from_pretrained`` without ``revision=``).

Invariant: what is linked is one snapshot (``…/snapshots/<commit>``, huggingface_hub's cache
layout) of the commit resolved first, so a branch that moves during the download cannot mix
two commits.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from engines.spec import COMMIT_SHA
from engines.trtllm.build_plan import SOURCE_RECORD

DEFAULT_BRANCH = "main"  # huggingface_hub constants.DEFAULT_REVISION: what an unset revision means
# Files transformers' from_pretrained never reads, left out of the download: Meta's original/*.pth
# checkpoints (Llama repos carry a second copy of the weights there) and other frameworks' formats.
_NEVER_READ = ("original/*", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data")


class DownloadError(RuntimeError):
    pass


def _hub_offline() -> bool:
    # huggingface_hub constants.py: HF_HUB_OFFLINE = _is_true(HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value or "").upper() in {"1", "ON", "YES", "TRUE"}


def _hub(hub: Any) -> Any:
    return hub if hub is not None else importlib.import_module("huggingface_hub")


def hub_commit(hf_id: str, revision: str | None, *, hub: Any = None) -> str:
    """The commit ``revision`` (None: the default branch) of the Hub repo ``hf_id`` names now (one API call)."""
    if _hub_offline():
        raise DownloadError("HF_HUB_OFFLINE is set")
    sha = _hub(hub).HfApi().model_info(hf_id, revision=revision).sha
    if not isinstance(sha, str) or not COMMIT_SHA.fullmatch(sha):
        raise DownloadError(f"the Hub gave no commit for {hf_id} at {revision or DEFAULT_BRANCH}")
    return sha


def download_hf_model(hf_id: str, revision: str | None, output: str | Path, *, hub: Any = None) -> dict[str, object]:
    """The build's download step: ``hf_id`` at ``revision`` into the Hugging Face cache, linked at ``output/<hf_id>``.

    The revision is resolved to a commit first and that commit downloaded (``snapshot_download`` returns
    ``…/snapshots/<commit>``, huggingface_hub's cache layout), so a branch that moves meanwhile cannot mix
    two commits. Offline (``HF_HUB_OFFLINE``) the cache answers. ``output/source.json`` records the commit.
    """
    if hf_id.startswith("/") or ".." in hf_id:  # huggingface_hub validate_repo_id refuses them too; never a path
        raise DownloadError(f"{hf_id!r} is not a Hugging Face repo id")
    hub = _hub(hub)
    ignore = list(_NEVER_READ)
    commit = revision if revision is not None and COMMIT_SHA.fullmatch(revision) else None
    if not _hub_offline():
        info = hub.HfApi().model_info(hf_id, revision=revision)
        commit = info.sha
        top = [s.rfilename for s in (info.siblings or ()) if "/" not in s.rfilename]
        # from_pretrained reads model.safetensors or the shards of model.safetensors.index.json when there are
        # safetensors: a pytorch_model*.bin twin or a consolidated*.safetensors copy would double the download.
        if any(name.endswith(".safetensors") for name in top):
            ignore.append("*.bin")
        if any(name.startswith("model") and name.endswith(".safetensors") for name in top):
            ignore.append("consolidated*.safetensors")
    snapshot = Path(hub.snapshot_download(hf_id, revision=commit or revision, ignore_patterns=ignore))
    got = snapshot.name
    if snapshot.parent.name != "snapshots" or not COMMIT_SHA.fullmatch(got):
        raise DownloadError(f"{hf_id}: the download is not a snapshot of one commit ({snapshot})")
    if commit is not None and got != commit:
        raise DownloadError(f"{hf_id}: asked for {commit}, got {got}")
    out = Path(output)
    link = out / hf_id
    link.parent.mkdir(parents=True, exist_ok=True)
    staging = link.with_name(f".{link.name}.new")
    staging.unlink(missing_ok=True)
    staging.symlink_to(snapshot, target_is_directory=True)
    os.replace(staging, link)
    record: dict[str, object] = {"hf_id": hf_id, "revision": revision, "resolved_revision": got,
                                 "snapshot": str(snapshot)}
    _write_record(out / SOURCE_RECORD, record)
    return record


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".json.tmp")  # written whole, then renamed: a reader never sees half of it
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
