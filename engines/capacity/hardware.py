"""Hardware a pool replica runs on: GPU type (bundled data), GPU count, parallelism, host KV memory.

A *replica* is one TensorRT-LLM executor: ``tensor_parallel × pipeline_parallel`` ranks, one
GPU each. ``gpus`` may hold several replicas (``gpus = replicas × world_size``). Host memory
for the KV tier is given either per rank (``host_cache_size``: TensorRT-LLM's unit, every rank
builds its own KV cache manager — ``calculateFreeMemBytes`` in
``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` returns ``hostCacheSize`` as that rank's
secondary bytes) or per replica (split evenly over its ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import yaml

from engines.spec import MAX_PARALLEL

GIB = 1 << 30
MIB = 1 << 20


class HardwareError(ValueError):
    """An impossible hardware description; the message names the option."""


@dataclass(frozen=True, slots=True)
class GpuType:
    key: str
    name: str
    memory_bytes: int  # total device memory as nvidia-smi / cudaMemGetInfo report it
    nominal_gb: float
    fp8: bool
    source: str


def bundled_gpus() -> dict[str, GpuType]:
    data = yaml.safe_load((resources.files("engines") / "capacity" / "data" / "gpus.yaml").read_text(encoding="utf-8"))
    return {
        key: GpuType(key, row["name"], int(row["memory_mib"]) * MIB, float(row["nominal_gb"]), bool(row["fp8"]), row["source"])
        for key, row in data.items()
    }


def load_gpu(name: str, *, memory_gib: float | None = None) -> GpuType:
    """A bundled GPU type by key (``h200-141gb``; a unique prefix like ``h200`` works), or a custom
    one when ``memory_gib`` is given (then ``name`` is only a label)."""
    gpus = bundled_gpus()
    if memory_gib is not None:
        if not memory_gib > 0:
            raise HardwareError("--gpu-memory-gib must be > 0")
        base = gpus.get(name)
        return GpuType(name, base.name if base else name, int(memory_gib * GIB), memory_gib,
                       base.fp8 if base else True, "given on the command line")
    if name in gpus:
        return gpus[name]
    matches = [key for key in gpus if key.startswith(name.lower())]
    if len(matches) == 1:
        return gpus[matches[0]]
    raise HardwareError(f"unknown GPU {name!r}; bundled: {', '.join(sorted(gpus))} (or give --gpu-memory-gib)")


@dataclass(frozen=True, slots=True)
class Hardware:
    gpu: GpuType
    gpus: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    host_cache_size: int = 0  # bytes per rank (TensorRT-LLM KvCacheConfig.host_cache_size)

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise HardwareError("--tp and --pp must be >= 1")
        if max(self.tensor_parallel, self.pipeline_parallel) > MAX_PARALLEL:  # no spec could build it
            raise HardwareError(f"--tp and --pp must be <= {MAX_PARALLEL} (an engine spec's bound), "
                                f"got {self.tensor_parallel} and {self.pipeline_parallel}")
        if self.gpus < 1 or self.gpus % self.world_size:
            raise HardwareError(f"--gpus ({self.gpus}) must be a positive multiple of tp × pp ({self.world_size})")
        if self.host_cache_size < 0:
            raise HardwareError("host memory must be >= 0")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def replicas(self) -> int:
        return self.gpus // self.world_size

    @property
    def host_bytes_per_replica(self) -> int:
        return self.host_cache_size * self.world_size
