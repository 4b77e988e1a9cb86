"""Loading ``tensorrt_llm.bindings.executor`` (TensorRT-LLM release/1.2) and checking its shape.

Every name kvgate uses is listed in :data:`REQUIRED_NAMES` with the binding source it was
confirmed in (``cpp/tensorrt_llm/nanobind/executor/``: ``bindings.cpp``, ``request.cpp``,
``executorConfig.cpp``, ``executor.cpp``). A missing name stops the model at load time
with a message naming it, instead of failing on the first request.

Not confirmed at the release/1.2 tag itself (the stored sources are main-branch
snapshots, see docs/architecture.md "Production path"): ``Request(cache_salt_id=...)``
(PR #7106, merged to main 2025-09-04, before the 1.2 branch). :func:`probe_cache_salt`
checks it against the running build; without it salted tenants are refused, never
served unsalted.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

EXECUTOR_MODULE = "tensorrt_llm.bindings.executor"

REQUIRED_NAMES: dict[str, str] = {
    "Executor": "nanobind/executor/executor.cpp: Executor(model_path, model_type, executor_config)",
    "ExecutorConfig": "nanobind/executor/executorConfig.cpp: ExecutorConfig(max_beam_width=, kv_cache_config=, ...)",
    "KvCacheConfig": "nanobind/executor/executorConfig.cpp: KvCacheConfig(enable_block_reuse=, ...)",
    "KvCacheRetentionConfig": "nanobind/executor/request.cpp: KvCacheRetentionConfig(token_range_retention_configs, ...)",
    "Request": "nanobind/executor/request.cpp: Request(input_token_ids, max_tokens, *, streaming=, ...)",
    "SamplingConfig": "nanobind/executor/request.cpp: SamplingConfig(beam_width=1, *, top_k=, top_p=, seed=, temperature=)",
    "OutputConfig": "nanobind/executor/request.cpp: OutputConfig(exclude_input_from_output=, return_perf_metrics=)",
    "ModelType": "nanobind/executor/bindings.cpp: ModelType.DECODER_ONLY",
    "ParallelConfig": "nanobind/executor/executorConfig.cpp: ParallelConfig(communication_mode=, orchestrator_config=)",
    "OrchestratorConfig": "nanobind/executor/executorConfig.cpp: OrchestratorConfig(is_orchestrator, worker_executable_path)",
    "CommunicationMode": "nanobind/executor/bindings.cpp: CommunicationMode.ORCHESTRATOR",
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
    if missing:
        raise BindingError(
            f"{EXECUTOR_MODULE} lacks {', '.join(missing)}: this is not the TensorRT-LLM 1.2 executor API kvgate was written against"
        )
    return module


def probe_cache_salt(module: ModuleType) -> bool:
    """True when ``Request`` accepts ``cache_salt_id`` (PR #7106; nanobind/executor/request.cpp)."""
    try:
        module.Request(input_token_ids=[0], max_tokens=1, cache_salt_id=1)
    except TypeError:
        return False
    return True
