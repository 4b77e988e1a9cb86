"""Loading ``tensorrt_llm.bindings.executor`` (TensorRT-LLM release/1.2) and checking its shape.

Every name kvgate uses is listed in :data:`REQUIRED_NAMES` with the binding source it was
read in (TensorRT-LLM ``cpp/tensorrt_llm/nanobind/executor/``: ``bindings.cpp``,
``request.cpp``, ``executorConfig.cpp``, ``executor.cpp``; the pybind twins under
``cpp/tensorrt_llm/pybind/executor/`` define the same Python names). A missing name stops
the model at load time with a message naming it, instead of failing on the first request.

What the sources are: main-branch snapshots of those files from the code index, read on
both sides of the release/1.2 branch point (late 2025 – early 2026), not the
``v1.2.1`` tag itself (the TensorRT-LLM repository is too large to mirror here; see
docs/architecture.md "Production path" for the table and what stays unconfirmed). Two
run-time checks close the gap on a real image:

* :func:`executor_version` reads ``__version__`` (bindings.cpp: ``m.attr("__version__") =
  tle::version()``, the ``tensorrt_llm/version.py`` string) so the model can refuse a build
  other than the spec's pin;
* :func:`probe_cache_salt` checks ``Request(cache_salt_id=...)`` (PR #7106, merged to main
  2025-09-04, before the 1.2 branch); without it salted tenants are refused, never served
  unsalted.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

EXECUTOR_MODULE = "tensorrt_llm.bindings.executor"

REQUIRED_NAMES: dict[str, str] = {
    "Executor": "executor.cpp: Executor(model_path, model_type, executor_config)",
    "ExecutorConfig": "executorConfig.cpp: ExecutorConfig(max_beam_width=1, ..., kv_cache_config=, iter_stats_max_iterations=, ...)",
    "KvCacheConfig": "executorConfig.cpp: KvCacheConfig(enable_block_reuse=True, max_tokens=, ..., event_buffer_max_size=0, *, ...)",
    "KvCacheRetentionConfig": "request.cpp: KvCacheRetentionConfig(token_range_retention_configs, decode_retention_priority=35, decode_duration_ms=None, ...)",
    "Request": "request.cpp: Request(input_token_ids, max_tokens, *, streaming=False, ..., cache_salt_id=None)",
    "SamplingConfig": "request.cpp: SamplingConfig(beam_width=1, *, top_k=, top_p=, seed=, temperature=, ...)",
    "OutputConfig": "request.cpp: OutputConfig(..., exclude_input_from_output=False, ..., return_perf_metrics=False, ...)",
    "ModelType": "bindings.cpp: ModelType.DECODER_ONLY",
    "ParallelConfig": "executorConfig.cpp: ParallelConfig(communication_type=, communication_mode=, ..., orchestrator_config=)",
    "OrchestratorConfig": "executorConfig.cpp: OrchestratorConfig(is_orchestrator=True, worker_executable_path='', ...)",
    "CommunicationMode": "bindings.cpp: CommunicationMode.LEADER / ORCHESTRATOR",
}


class BindingError(RuntimeError):
    """The TensorRT-LLM bindings are absent or lack a name kvgate relies on."""


def load_executor_bindings(importer: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    try:
        module = importer(EXECUTOR_MODULE)
    except ImportError as exc:
        raise BindingError(
            f"cannot import {EXECUTOR_MODULE} ({exc}); the kvgate Triton model runs only inside the "
            "TensorRT-LLM 1.2 Triton image (tritonserver:<yy.mm>-trtllm-python-py3, see README)"
        ) from exc
    missing = [name for name in REQUIRED_NAMES if not hasattr(module, name)]
    if "KvCacheRetentionConfig" not in missing and not hasattr(module.KvCacheRetentionConfig, "TokenRangeRetentionConfig"):
        missing.append("KvCacheRetentionConfig.TokenRangeRetentionConfig")
    if "ModelType" not in missing and not hasattr(module.ModelType, "DECODER_ONLY"):
        missing.append("ModelType.DECODER_ONLY")
    if "CommunicationMode" not in missing and not hasattr(module.CommunicationMode, "ORCHESTRATOR"):
        missing.append("CommunicationMode.ORCHESTRATOR")
    if missing:
        raise BindingError(
            f"{EXECUTOR_MODULE} lacks {', '.join(missing)}: this is not the TensorRT-LLM 1.2 executor API kvgate was written against"
        )
    return module


def executor_version(module: ModuleType) -> str | None:
    """The TensorRT-LLM version the bindings were built as (bindings.cpp ``__version__``), None if absent."""
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else None


def check_version(module: ModuleType, pinned: str) -> str | None:
    """Refuse bindings whose ``__version__`` differs from the spec's pin (engines are not portable).

    Returns the version read (None when the module does not say; the caller logs that).
    """
    version = executor_version(module)
    if version is not None and version != pinned:
        raise BindingError(
            f"{EXECUTOR_MODULE} is TensorRT-LLM {version} but the engine spec pins {pinned}: "
            "engines are tied to the exact release that built them; use the matching Triton image"
        )
    return version


def probe_cache_salt(module: ModuleType) -> bool:
    """True when ``Request`` accepts ``cache_salt_id`` (PR #7106; nanobind/executor/request.cpp)."""
    try:
        module.Request(input_token_ids=[0], max_tokens=1, cache_salt_id=1)
    except TypeError:
        return False
    return True
