"""Which dtypes a TensorRT-LLM engine spec can take, and the nearest valid choice to the user's.

``kvgate plan`` sizes any combination the user asks for, but the spec values it prints must
pass the spec validator (``engines/spec.py`` ``EngineSpec``), whose TensorRT-LLM rules are:

* KV in FP8 (E4M3): TensorRT-LLM's FP8 KV, the point of the design;
* weights FP8 with an FP8 KV cache (rule ``fp8-kv-needs-fp8-weights``): ``tensorrt_llm/builder.py``
  ``build()`` drops paged context FMHA otherwise, and the executor then runs with block reuse
  silently off (``trtGptModelInflightBatching.cpp`` ``fixExecutorConfig``);
* both need a GPU with FP8 (SM >= 89: Ada, Hopper, Blackwell).

Invariant: :func:`spec_choice` returns FP8/FP8 on an FP8 GPU (with ``reason`` None exactly when
that is what the user asked for), and None on a GPU where no valid spec exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.capacity.hardware import GpuType


@dataclass(frozen=True, slots=True)
class SpecChoice:
    kv_dtype: str
    weight_dtype: str
    reason: str | None = None  # why the user's choice was changed; None: it was valid

    @property
    def flags(self) -> str:
        return f"--kv-dtype {self.kv_dtype} --weights {self.weight_dtype}"


def spec_choice(kv_dtype: str, weight_dtype: str, gpu: GpuType) -> SpecChoice | None:
    """The dtypes of the spec ``plan`` prints for the user's ``kv_dtype`` / ``weight_dtype`` on ``gpu``."""
    if not gpu.fp8:
        return None
    if kv_dtype == "fp8" and weight_dtype == "fp8":
        return SpecChoice("fp8", "fp8")
    if kv_dtype != "fp8":
        reason = (f"--kv-dtype {kv_dtype}: kvgate's TensorRT-LLM engines store KV in FP8 (E4M3), so no spec takes "
                  f"{kv_dtype} KV")
    else:
        reason = (f"--weights {weight_dtype} with FP8 KV cannot keep KV block reuse: TensorRT-LLM's builder drops "
                  "paged context FMHA without FP8 weights and the executor then silently disables reuse "
                  "(spec rule fp8-kv-needs-fp8-weights)")
    return SpecChoice("fp8", "fp8", reason)


def no_spec_reason(gpu: GpuType) -> str:
    return (f"{gpu.name} has no FP8: kvgate's TensorRT-LLM engines need FP8 KV and FP8 weights (SM >= 89), so no "
            "engine spec is valid on it; the figures above are for sizing only")
