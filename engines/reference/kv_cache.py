"""Paged KV storage: a primary ("device") and a secondary (host) tensor of blocks.

Layout of each tier (one tensor, all layers, so a block copy is one slice assignment)::

    tier[layer, token_slot, 2 * kv_heads * head_dim]      row = [K heads | V heads]
         token_slot = block_slot * tokens_per_block + offset_in_block

(K and V of one token sit in one row, so a step writes each layer with one indexed copy
and reads a context with one gather.)

The block manager (``retention.pool.BlockPool``) hands out *block slots* per tier; this
module only stores bytes at those slots and moves them when told (offload: primary →
secondary, onboard: secondary → primary).

Storage dtypes: ``fp32``, ``fp16``, ``bf16`` store values as they are; ``fp8_e4m3``
stores ``clamp(x / scale, ±448)`` as E4M3 with one scale per layer (K and V share it),
the per-tensor scaling TensorRT-LLM applies to an FP8 KV cache
(``kv_cache_scaling_factor`` per attention layer, written by
``examples/quantization/quantize.py --kv_cache_dtype fp8`` in NVIDIA/TensorRT-LLM);
``fp8_e5m2`` stores ``clamp(x, ±57344)`` unscaled (vLLM's E5M2 cache; TensorRT-LLM has
no E5M2 KV). Values are clamped before the cast because an out-of-range cast to E5M2
gives ±inf.

Invariant: ``read`` returns exactly ``dequantize(quantize(x))`` for every ``x`` that
``write`` stored, whichever tier the block has travelled through; copies are bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class KvDtype(str, Enum):
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def storage(self) -> torch.dtype:
        return _STORAGE[self]

    @property
    def is_fp8(self) -> bool:
        return self in (KvDtype.FP8_E4M3, KvDtype.FP8_E5M2)

    @property
    def bytes_per_value(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()


_STORAGE = {
    KvDtype.FP8_E4M3: torch.float8_e4m3fn,
    KvDtype.FP8_E5M2: torch.float8_e5m2,
    KvDtype.BF16: torch.bfloat16,
    KvDtype.FP16: torch.float16,
    KvDtype.FP32: torch.float32,
}
_FP8_MAX = {KvDtype.FP8_E4M3: 448.0, KvDtype.FP8_E5M2: 57344.0}
# fp32 bit mask keeping the sign (bit 31) and E4M3's 7 exponent/mantissa bits moved to 20..26
# (0x87F00000 as a signed int32).
_SIGN_EXPONENT_MANTISSA = 0x87F00000 - (1 << 32)


@dataclass(frozen=True, slots=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int

    @property
    def row_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def bytes_per_block(self, dtype: KvDtype) -> int:
        return self.num_layers * 2 * self.tokens_per_block * self.row_size * dtype.bytes_per_value


class PagedKvCache:
    """Two tiers of KV blocks plus the quantize/dequantize rules of one ``KvDtype``."""

    def __init__(
        self,
        geometry: KvGeometry,
        dtype: KvDtype,
        *,
        primary_blocks: int,
        secondary_blocks: int = 0,
        scales: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        if primary_blocks < 1:
            raise ValueError(f"primary_blocks must be >= 1, got {primary_blocks}")
        if secondary_blocks < 0:
            raise ValueError(f"secondary_blocks must be >= 0, got {secondary_blocks}")
        self.geometry = geometry
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        bs = geometry.tokens_per_block
        width = 2 * geometry.row_size
        self.primary = torch.zeros((geometry.num_layers, primary_blocks * bs, width), dtype=dtype.storage)
        self.secondary = torch.zeros((geometry.num_layers, secondary_blocks * bs, width), dtype=dtype.storage)
        if scales is None:
            scales = torch.ones(geometry.num_layers, dtype=torch.float32)
        if scales.shape != (geometry.num_layers,):
            raise ValueError(f"scales must have shape ({geometry.num_layers},), got {tuple(scales.shape)}")
        if dtype is not KvDtype.FP8_E4M3:
            scales = torch.ones(geometry.num_layers, dtype=torch.float32)
        self.scales = scales.to(torch.float32).clone()
        self._inv_scales = [float(1.0 / s) for s in self.scales]
        self._scale_values = [float(s) for s in self.scales]
        self._limit = _FP8_MAX.get(dtype)
        # E4M3 -> float: the elementwise cast is ~7x slower on CPU than E5M2's. Instead the
        # sign-extended byte is shifted so its exponent/mantissa bits land in fp32's field
        # positions (exact, subnormals included: the two formats then differ by exactly
        # 2^120), masked, and the factor is folded into the layer's scale. In-place int32
        # ops: ~5x faster than the cast.
        self._e4m3_factors = [s * 2.0**120 for s in self._scale_values]

    @property
    def primary_blocks(self) -> int:
        return self.primary.shape[1] // self.geometry.tokens_per_block

    @property
    def secondary_blocks(self) -> int:
        return self.secondary.shape[1] // self.geometry.tokens_per_block

    def nbytes(self) -> tuple[int, int]:
        return (
            self.primary.numel() * self.primary.element_size(),
            self.secondary.numel() * self.secondary.element_size(),
        )

    # Values ---------------------------------------------------------------------------
    def quantize(self, layer: int, values: torch.Tensor) -> torch.Tensor:
        if not self.dtype.is_fp8:
            return values.to(self.dtype.storage)
        scaled = values * self._inv_scales[layer] if self.dtype is KvDtype.FP8_E4M3 else values
        return scaled.clamp(-self._limit, self._limit).to(self.dtype.storage)

    def dequantize(self, layer: int, stored: torch.Tensor) -> torch.Tensor:
        if self.dtype is KvDtype.FP8_E4M3:
            bits = stored.view(torch.int8).to(torch.int32)  # sign-extended
            bits.bitwise_left_shift_(20).bitwise_and_(_SIGN_EXPONENT_MANTISSA)
            values = bits.view(torch.float32).mul_(self._e4m3_factors[layer])
            return values if self.compute_dtype == torch.float32 else values.to(self.compute_dtype)
        return stored.to(self.compute_dtype)

    def write(self, layer: int, rows: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Store ``rows`` ``[T, 2*kv_heads*head_dim]`` (K then V) at primary ``token_slots`` ``[T]``."""
        stored = self.quantize(layer, rows)
        if self.dtype.is_fp8:  # index_copy_/index_select have no FP8 kernels on CPU: move bytes
            self.primary[layer].view(torch.uint8).index_copy_(0, token_slots, stored.view(torch.uint8))
        else:
            self.primary[layer].index_copy_(0, token_slots, stored)

    def read(self, layer: int, token_slots: torch.Tensor) -> torch.Tensor:
        """Dequantized ``[*token_slots.shape, 2*row]`` gathered from the primary tier."""
        flat = token_slots.reshape(-1)
        if self.dtype.is_fp8:
            stored = self.primary[layer].view(torch.uint8).index_select(0, flat).view(self.dtype.storage)
        else:
            stored = self.primary[layer].index_select(0, flat)
        return self.dequantize(layer, stored).view(*token_slots.shape, 2 * self.geometry.row_size)

    # Blocks ---------------------------------------------------------------------------
    def _tier(self, tier: int) -> torch.Tensor:
        return self.primary if int(tier) == 0 else self.secondary

    def copy_block(self, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        """Copy one block's bytes (every layer, K and V) between tiers or within one."""
        bs = self.geometry.tokens_per_block
        src, dst = self._tier(src_tier), self._tier(dst_tier)
        dst[:, dst_slot * bs : (dst_slot + 1) * bs] = src[:, src_slot * bs : (src_slot + 1) * bs]

    def block_bytes(self, tier: int, slot: int) -> torch.Tensor:
        """A copy of one block's raw storage (for tests that follow bytes across tiers)."""
        bs = self.geometry.tokens_per_block
        return self._tier(tier)[:, slot * bs : (slot + 1) * bs].clone()
