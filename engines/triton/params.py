"""The ``kvgate_llm`` model's serving parameters: spec → config.pbtxt ``parameters`` → model.

One typed record travels both ways: :meth:`ServingParams.from_spec` (the renderer) and
:meth:`ServingParams.from_model_config` (``model.py``'s ``initialize``, which receives the
config as JSON, ``{"parameters": {key: {"string_value": ...}}}``). Keys that exist in the
stock tensorrtllm backend keep its names. Checked in triton-inference-server/
tensorrtllm_backend branch r26.04 (ce68ff5) ``docs/model_config.md``: ``engine_dir``,
``max_queue_size``, ``iter_stats_max_iterations``, ``max_tokens_in_paged_kv_cache``,
``kv_cache_free_gpu_mem_fraction``, ``kv_cache_host_memory_bytes``,
``enable_kv_cache_reuse``. Not in that document but read by the stock models
(TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/model_instance_state.cc`` and
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py``):
``kv_cache_onboard_blocks`` and ``executor_worker_path``. The rest are kvgate's and say so
in their ``kvgate_`` or ``kv_cache_`` names: the upstream C++ backend (model_instance_state.cc
at TensorRT-LLM 0c8de69a) has no key for ``secondary_offload_min_priority``, the event
buffer or the partial-reuse switches — the reason this model exists.

Invariant: ``from_model_config(render(p)) == p`` for every valid ``p`` (tested), and a
missing or malformed parameter is an error naming the key, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engines.spec import EngineSpec, spec_hash


class ParamsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ServingParams:
    engine_dir: str
    spec_name: str
    spec_hash: str
    tensorrt_llm_version: str
    tokens_per_block: int
    max_batch_size: int
    max_input_len: int
    max_output_len: int
    max_num_tokens: int
    vocab_size: int
    end_id: int | None
    # KvCacheConfig (executor.h)
    enable_block_reuse: bool
    free_gpu_memory_fraction: float
    max_tokens: int | None
    host_cache_size: int  # bytes pinned by each rank (KvCacheConfig.host_cache_size; spec host_cache_size_per_rank)
    onboard_blocks: bool
    secondary_offload_min_priority: int
    event_buffer_max_size: int
    enable_partial_reuse: bool
    copy_on_partial_reuse: bool
    # executor / model loop
    iter_stats_max_iterations: int
    max_queue_size: int | None
    response_poll_ms: int
    # parallelism: world_size > 1 runs the executor in orchestrator mode (it spawns one
    # worker process per rank), so a single Triton model instance drives all GPUs.
    world_size: int
    executor_worker_path: str
    # GuidedDecodingConfig (XGRAMMAR) is built from <tokenizer_dir>/tokenizer.json; None: guides refused
    tokenizer_dir: str | None = None

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, engine_dir: str, tokenizer_dir: str | None = None) -> ServingParams:
        if spec.backend != "tensorrt_llm" or spec.tensorrt_llm is None:
            raise ParamsError(f"spec {spec.name!r} is not a TensorRT-LLM spec; the Triton model serves only those")
        b, kv, t = spec.build, spec.kv_cache, spec.triton
        return cls(
            engine_dir=engine_dir,
            spec_name=spec.name,
            spec_hash=spec_hash(spec),
            tensorrt_llm_version=spec.tensorrt_llm.version,
            tokens_per_block=b.tokens_per_block,
            max_batch_size=b.max_batch_size,
            max_input_len=b.max_input_len,
            max_output_len=b.max_seq_len - b.max_input_len,
            max_num_tokens=b.max_num_tokens,
            vocab_size=t.vocab_size,
            end_id=t.end_id,
            enable_block_reuse=kv.enable_block_reuse,
            free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
            max_tokens=kv.max_tokens,
            host_cache_size=kv.host_cache_size_per_rank,  # KvCacheConfig.host_cache_size is per rank
            onboard_blocks=kv.onboard_blocks,
            secondary_offload_min_priority=kv.secondary_offload_min_priority,
            event_buffer_max_size=kv.event_buffer_max_size,
            enable_partial_reuse=kv.enable_partial_reuse,
            copy_on_partial_reuse=kv.copy_on_partial_reuse,
            iter_stats_max_iterations=t.iter_stats_max_iterations,
            max_queue_size=t.max_queue_size,
            response_poll_ms=t.response_poll_ms,
            world_size=b.world_size,
            executor_worker_path=t.executor_worker_path,
            tokenizer_dir=tokenizer_dir,
        )

    def to_parameters(self) -> dict[str, str]:
        """config.pbtxt ``parameters`` (all string values, as Triton stores them); None → ``""``."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            key = PARAMETER_KEYS[f.name]
            if value is None:
                out[key] = ""
            elif isinstance(value, bool):
                out[key] = "true" if value else "false"
            else:
                out[key] = str(value)
        return out

    @classmethod
    def from_parameters(cls, raw: dict[str, str]) -> ServingParams:
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = PARAMETER_KEYS[f.name]
            if key not in raw:
                raise ParamsError(f"config.pbtxt parameter {key!r} is missing")
            values[f.name] = _convert(key, raw[key], f.type)
        return cls(**values)

    @classmethod
    def from_model_config(cls, model_config: str | dict) -> ServingParams:
        """Parse Triton's ``args['model_config']`` JSON (python_backend ``initialize`` contract)."""
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        params = config.get("parameters", {})
        raw = {k: v.get("string_value", "") if isinstance(v, dict) else str(v) for k, v in params.items()}
        return cls.from_parameters(raw)


def _convert(key: str, text: str, annotation: str) -> Any:
    optional = "None" in annotation
    if text == "":
        if optional:
            return None
        raise ParamsError(f"config.pbtxt parameter {key!r} is empty")
    base = annotation.replace(" | None", "")
    try:
        if base == "bool":
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        return text
    except ValueError as exc:
        raise ParamsError(f"config.pbtxt parameter {key!r} must be a {base}, got {text!r}") from exc


PARAMETER_KEYS: dict[str, str] = {
    "engine_dir": "engine_dir",  # stock (tensorrtllm_backend r26.04 docs/model_config.md)
    "spec_name": "kvgate_spec_name",
    "spec_hash": "kvgate_spec_hash",
    "tensorrt_llm_version": "kvgate_tensorrt_llm_version",
    "tokens_per_block": "kvgate_tokens_per_block",
    "max_batch_size": "kvgate_max_batch_size",
    "max_input_len": "kvgate_max_input_len",
    "max_output_len": "kvgate_max_output_len",
    "max_num_tokens": "kvgate_max_num_tokens",
    "vocab_size": "kvgate_vocab_size",
    "end_id": "kvgate_end_id",
    "enable_block_reuse": "enable_kv_cache_reuse",  # stock (docs/model_config.md)
    "free_gpu_memory_fraction": "kv_cache_free_gpu_mem_fraction",  # stock (docs/model_config.md)
    "max_tokens": "max_tokens_in_paged_kv_cache",  # stock (docs/model_config.md)
    "host_cache_size": "kv_cache_host_memory_bytes",  # stock (docs/model_config.md)
    "onboard_blocks": "kv_cache_onboard_blocks",  # stock (model_instance_state.cc, tensorrt_llm/1/model.py; undocumented)
    "secondary_offload_min_priority": "kv_cache_secondary_offload_min_priority",  # kvgate: stock has no key
    "event_buffer_max_size": "kv_cache_event_buffer_max_size",  # kvgate: stock has no key
    "enable_partial_reuse": "kv_cache_enable_partial_reuse",
    "copy_on_partial_reuse": "kv_cache_copy_on_partial_reuse",
    "iter_stats_max_iterations": "iter_stats_max_iterations",  # stock (docs/model_config.md)
    "max_queue_size": "max_queue_size",  # stock (docs/model_config.md)
    "response_poll_ms": "kvgate_response_poll_ms",
    "world_size": "kvgate_world_size",
    "executor_worker_path": "executor_worker_path",  # stock (model_state.cc GetExecutorWorkerPath, tensorrt_llm/1/model.py)
    # stock: the tensorrt_llm model's `tokenizer_dir` (TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/
    # tensorrt_llm/config.pbtxt; tensorrt_llm/1/model.py builds GuidedDecodingConfig from it)
    "tokenizer_dir": "tokenizer_dir",
}
