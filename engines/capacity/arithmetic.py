"""Capacity arithmetic: KV bytes per token, weight bytes, KV blocks per replica, concurrency.

Pure functions over :class:`ModelShape` and :class:`Hardware`; no I/O. The sizing follows
TensorRT-LLM 1.2 (``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``):

* ``calculateFreeMemBytes``: primary KV bytes = *free* device memory after the engine is
  loaded (weights, activations, runtime buffers) × ``free_gpu_memory_fraction`` (default
  0.9, ``executor::KvCacheConfig::kDefaultGpuMemFraction``); secondary bytes =
  ``host_cache_size`` — both per rank. ``docs/source/reference/memory.md``: weights are split
  over TP/PP ranks ("each rank typically uses just 1/8 of the model weights" at TP 8),
  activation memory is fixed at engine build time.
* ``calculateCacheSizePerTokenForSingleWindowSize``: bytes per token =
  ``Σ_local layers kvFactor × numKvHeads(per rank) × sizePerHead × dtype size`` with
  ``kvFactor`` 2 (K and V). MLA caches one latent per token and layer, ``num_kv_heads=1``,
  ``head_dim = kv_lora_rank + qk_rope_head_dim``, K only (``tensorrt_llm/_torch/pyexecutor/
  _util.py`` ``KvCacheCreator``: ``CacheType.SELFKONLY``); SGLang's ``MLATokenToKVPool``
  stores the same ``[tokens, 1, kv_lora_rank + qk_rope_head_dim]``. The latent has no head
  axis, so every TP rank holds all of it (``resource_manager.py``
  ``KVCacheManager.get_cache_size_per_token``: MLA ⇒ ``kv_factor = 1``, no division by
  ``tp_size``; only GQA/MHA head dims are divided, and not under attention DP); GQA heads are
  dealt out over TP ranks and replicated when ``tp > num_kv_heads``.
* ``calculateMaxNumBlocks``: primary blocks = ``ceil(floor(bytes / bytes_per_token) /
  tokens_per_block)``, secondary blocks = ``floor(floor(host / bytes_per_token) /
  tokens_per_block)``, then the MIN over ranks (all ranks of a replica agree). So a pool's
  ``primary_blocks`` is *one rank's* block count, not a sum over ranks.
* ``getMaxCapacityBatchSize``: sequences = primary blocks // ``ceil(length / tokens_per_block)``.

Weights: every linear weight of attention, dense MLPs and *all* experts (MoE experts are
resident whether routed to or not) at the weight dtype; embeddings, ``lm_head``, routers,
norms and biases stay 16-bit (FP8 checkpoints quantize only the linear layers). FP8 scale
factors (< 0.1 %) are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from engines.capacity.hardware import GIB, Hardware
from engines.capacity.shapes import ModelShape
from engines.spec import MAX_TOKENS_PER_BLOCK

Dtype = Literal["fp32", "fp16", "bf16", "fp8"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
DEFAULT_FREE_GPU_MEMORY_FRACTION = 0.9  # executor::KvCacheConfig::kDefaultGpuMemFraction


class PlanError(ValueError):
    """Inputs that cannot give a plan (weights do not fit, bad fraction, ...)."""


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPE_BYTES)}") from None


# --- KV -----------------------------------------------------------------------------------------
def kv_values_per_token_per_layer(shape: ModelShape) -> int:
    """Cached values per token and layer for the whole model (all heads)."""
    if shape.mla is not None:
        return shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim
    return 2 * shape.num_kv_heads * shape.head_dim


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """Model KV bytes per token (all layers, all heads, counted once)."""
    return shape.num_layers * kv_values_per_token_per_layer(shape) * dtype_bytes(kv_dtype)


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads one TP rank caches: a share of the heads, at least one (replicated when tp > heads)."""
    return max(1, -(-shape.num_kv_heads // tp))


def kv_bytes_per_token_per_rank(shape: ModelShape, kv_dtype: str, tp: int, pp: int) -> int:
    """What one rank's KV cache manager stores per token (its layers, its heads)."""
    layers = -(-shape.num_layers // pp)
    if shape.mla is not None:  # the latent has no head axis: every TP rank holds all of it
        per_layer = shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim
    else:
        per_layer = 2 * kv_heads_per_rank(shape, tp) * shape.head_dim
    return layers * per_layer * dtype_bytes(kv_dtype)


# --- weights ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters by part. ``linear`` parts take the weight dtype; the rest stays 16-bit."""

    embedding: int
    lm_head: int
    attention: int  # linear weights
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    routers: int
    norms_and_biases: int

    @property
    def linear(self) -> int:
        return self.attention + self.dense_mlp + self.routed_experts + self.shared_experts

    @property
    def unquantized(self) -> int:
        return self.embedding + self.lm_head + self.routers + self.norms_and_biases

    @property
    def total(self) -> int:
        return self.linear + self.unquantized


def count_params(shape: ModelShape) -> ParamCount:
    h, heads, d = shape.hidden_size, shape.num_attention_heads, shape.head_dim
    small_per_layer = 2 * h  # input + post-attention RMSNorm
    if shape.mla is not None:
        m = shape.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank * heads * qk_dim
            small_per_layer += m.q_lora_rank  # q_a_layernorm
        else:
            q = h * heads * qk_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        small_per_layer += m.kv_lora_rank  # kv_a_layernorm
        attention_per_layer = q + kv + heads * m.v_head_dim * h
    else:
        kvh = shape.num_kv_heads
        attention_per_layer = h * heads * d + 2 * h * kvh * d + heads * d * h
        if shape.qkv_bias:
            small_per_layer += heads * d + 2 * kvh * d
        if shape.qk_norm:
            small_per_layer += 2 * d
    dense_mlp = routed = shared = routers = 0
    for layer in range(shape.num_layers):
        if shape.is_moe_layer(layer):
            moe = shape.moe
            assert moe is not None
            routed += moe.num_experts * 3 * h * moe.expert_intermediate_size
            shared += moe.num_shared_experts * 3 * h * moe.shared_intermediate_size
            routers += h * moe.num_experts
            if shape.model_type == "deepseek_v3":
                routers += moe.num_experts  # e_score_correction_bias
        else:
            assert shape.intermediate_size is not None
            dense_mlp += 3 * h * shape.intermediate_size  # gate, up, down (SwiGLU)
    embedding = shape.vocab_size * h
    return ParamCount(
        embedding=embedding,
        lm_head=0 if shape.tie_word_embeddings else embedding,
        attention=attention_per_layer * shape.num_layers,
        dense_mlp=dense_mlp, routed_experts=routed, shared_experts=shared, routers=routers,
        norms_and_biases=small_per_layer * shape.num_layers + h,  # + final norm
    )


def weight_bytes(shape: ModelShape, weight_dtype: str) -> int:
    params = count_params(shape)
    return params.linear * dtype_bytes(weight_dtype) + params.unquantized * 2


# --- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlanInputs:
    kv_dtype: str = "fp8"
    weight_dtype: str = "bf16"
    tokens_per_block: int = 32
    free_gpu_memory_fraction: float = DEFAULT_FREE_GPU_MEMORY_FRACTION
    runtime_reserve_bytes: int = 4 * GIB  # per rank: activations, CUDA context, NCCL, runtime buffers
    context_length: int = 8192
    sequences: int | None = None  # "how much KV do N sequences at context_length need?"

    def __post_init__(self) -> None:
        dtype_bytes(self.kv_dtype)
        dtype_bytes(self.weight_dtype)
        if not 2 <= self.tokens_per_block <= MAX_TOKENS_PER_BLOCK or self.tokens_per_block & (self.tokens_per_block - 1):
            raise PlanError(f"tokens_per_block must be a power of two within [2, {MAX_TOKENS_PER_BLOCK}] "
                            f"(an engine spec's bounds), got {self.tokens_per_block}")
        # kvCacheManager.cpp calculateFreeMemBytes: TLLM_CHECK(freeMemFraction < 1.0F)
        if not 0.0 < self.free_gpu_memory_fraction < 1.0:
            raise PlanError(f"free_gpu_memory_fraction must be within (0, 1), got {self.free_gpu_memory_fraction}")
        if self.runtime_reserve_bytes < 0:
            raise PlanError("the runtime reserve must be >= 0")
        if self.context_length < 1:
            raise PlanError("the context length must be >= 1")
        if self.sequences is not None and self.sequences < 1:
            raise PlanError("--sequences must be >= 1")


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    model: str
    attention: str
    gpu: str
    gpus: int
    replicas: int
    tensor_parallel: int
    pipeline_parallel: int
    kv_dtype: str
    weight_dtype: str
    tokens_per_block: int
    free_gpu_memory_fraction: float
    params: int
    kv_bytes_per_token: int  # model, counted once
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_token_per_replica: int  # Σ over ranks (> model figure when KV is replicated)
    block_bytes_per_rank: int
    weight_bytes: int
    weight_bytes_per_rank: int
    gpu_memory_bytes: int
    runtime_reserve_bytes: int
    free_bytes_per_rank: int  # after weights and reserve (what cudaMemGetInfo would report)
    kv_bytes_per_rank: int  # × free_gpu_memory_fraction
    primary_tokens: int  # per replica (= per rank: ranks hold the same tokens)
    primary_blocks: int
    host_cache_size: int  # bytes per rank
    host_bytes_per_replica: int
    secondary_blocks: int
    context_length: int
    blocks_per_sequence: int
    concurrent_sequences: int  # per replica
    sequences: int | None = None
    kv_bytes_for_sequences: int | None = None  # model bytes, sequences × context_length tokens
    kv_hbm_bytes_for_sequences: int | None = None  # block-rounded, over all ranks (replicas' HBM)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def registration(self) -> dict[str, int]:
        """The pool fields of the admin API / registry.yaml (one replica's blocks)."""
        return {"tokens_per_block": self.tokens_per_block, "primary_blocks": self.primary_blocks,
                "secondary_blocks": self.secondary_blocks}

    def spec_values(self) -> dict[str, object]:
        """The engine-spec values this plan assumes (engines/specs/*.yaml)."""
        return {
            "quantization": {"kv_cache": self.kv_dtype, "weights": "fp8" if self.weight_dtype == "fp8" else "none"},
            "build": {"tokens_per_block": self.tokens_per_block, "tensor_parallel": self.tensor_parallel,
                      "pipeline_parallel": self.pipeline_parallel},
            "kv_cache": {"free_gpu_memory_fraction": self.free_gpu_memory_fraction,
                         "host_cache_size_per_rank": self.host_cache_size},
        }

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        data["registration"] = self.registration()
        data["spec"] = self.spec_values()
        return data


def host_cache_size_for_blocks(blocks: int, block_bytes_per_rank: int) -> int:
    """The reverse: ``host_cache_size`` (bytes per rank) that yields exactly ``blocks`` host blocks."""
    if blocks < 0:
        raise PlanError("--host-blocks must be >= 0")
    return blocks * block_bytes_per_rank


def plan(shape: ModelShape, hardware: Hardware, inputs: PlanInputs) -> CapacityPlan:
    tp, pp, tpb = hardware.tensor_parallel, hardware.pipeline_parallel, inputs.tokens_per_block
    notes: list[str] = []
    if inputs.kv_dtype == "fp8" and not hardware.gpu.fp8:
        raise PlanError(f"{hardware.gpu.name} has no FP8 support: use --kv-dtype fp16/bf16")
    if inputs.weight_dtype == "fp8" and not hardware.gpu.fp8:
        raise PlanError(f"{hardware.gpu.name} has no FP8 support: use --weights bf16")
    per_token_model = kv_bytes_per_token(shape, inputs.kv_dtype)
    per_token_rank = kv_bytes_per_token_per_rank(shape, inputs.kv_dtype, tp, pp)
    params = count_params(shape)
    weights = weight_bytes(shape, inputs.weight_dtype)
    weights_rank = -(-weights // hardware.world_size)
    free = hardware.gpu.memory_bytes - weights_rank - inputs.runtime_reserve_bytes
    if free <= 0:
        raise PlanError(
            f"{shape.name} weights need {weights_rank / GIB:.1f} GiB per rank (+ {inputs.runtime_reserve_bytes / GIB:.1f} GiB "
            f"reserve) but a {hardware.gpu.name} has {hardware.gpu.memory_bytes / GIB:.1f} GiB: raise --tp/--pp or use FP8 weights")
    kv_rank = int(free * inputs.free_gpu_memory_fraction)
    max_tokens = kv_rank // per_token_rank
    primary_blocks = -(-max_tokens // tpb)  # calculateMaxNumBlocks: ceilDiv(maxTokens, tokensPerBlock)
    secondary_blocks = (hardware.host_cache_size // per_token_rank) // tpb
    blocks_per_seq = -(-inputs.context_length // tpb)
    if shape.mla is not None and tp > 1:
        notes.append(f"MLA latent is replicated on all {tp} TP ranks: the replica stores {tp}× the model's KV bytes "
                     "per token (attention data parallelism avoids this; not modelled)")
    elif shape.num_kv_heads < tp:
        notes.append(f"{shape.num_kv_heads} KV heads < TP {tp}: each head is replicated on {tp // shape.num_kv_heads} ranks")
    kv_for_seqs = hbm_for_seqs = None
    if inputs.sequences is not None:
        kv_for_seqs = inputs.sequences * inputs.context_length * per_token_model
        hbm_for_seqs = inputs.sequences * blocks_per_seq * tpb * per_token_rank * hardware.world_size
    return CapacityPlan(
        model=shape.name, attention=shape.attention, gpu=hardware.gpu.key, gpus=hardware.gpus,
        replicas=hardware.replicas, tensor_parallel=tp, pipeline_parallel=pp, kv_dtype=inputs.kv_dtype,
        weight_dtype=inputs.weight_dtype, tokens_per_block=tpb, free_gpu_memory_fraction=inputs.free_gpu_memory_fraction,
        params=params.total, kv_bytes_per_token=per_token_model, kv_bytes_per_token_per_rank=per_token_rank,
        kv_bytes_per_token_per_replica=per_token_rank * hardware.world_size, block_bytes_per_rank=per_token_rank * tpb,
        weight_bytes=weights, weight_bytes_per_rank=weights_rank, gpu_memory_bytes=hardware.gpu.memory_bytes,
        runtime_reserve_bytes=inputs.runtime_reserve_bytes, free_bytes_per_rank=free, kv_bytes_per_rank=kv_rank,
        primary_tokens=max_tokens, primary_blocks=primary_blocks, host_cache_size=hardware.host_cache_size,
        host_bytes_per_replica=hardware.host_bytes_per_replica, secondary_blocks=secondary_blocks,
        context_length=inputs.context_length, blocks_per_sequence=blocks_per_seq,
        concurrent_sequences=primary_blocks // blocks_per_seq, sequences=inputs.sequences,
        kv_bytes_for_sequences=kv_for_seqs, kv_hbm_bytes_for_sequences=hbm_for_seqs, notes=tuple(notes),
    )

