"""Linear layers for the reference forward: dense fp32/bf16, or the GGUF's own 4-bit weights.

Decode at small batch is memory-bound: every step streams every weight once. The
``q4`` backend keeps SmolLM2's Q4_1 matrices 4-bit (as llama.cpp does) instead of
dequantizing them to fp32, cutting the bytes per step ~7x. The conversion keeps the
4-bit codes: a Q4_1 block of 32 values stores ``w = d*q + m`` (``q`` in 0..15, ``d``/``m``
fp16, ggml ``block_q4_1``); torch's CPU int4 kernel computes ``w = (q - 8)*scale + zero``
per group of 32 along K, so ``scale = d`` and ``zero = m + 8d`` give the same weights up
to the kernel's bf16 scales (relative rounding 2^-9 of ``d`` and ``zero``). Its
activations are bf16 (the kernel's vectorised path); the residual stream stays fp32.

For more rows than the 4-bit kernel handles well, the same matrix is kept once more,
pre-packed into oneDNN's blocked layout (:class:`PackedLinear`), the way TorchInductor's
CPU freezing pass runs linears (``torch/_inductor/fx_passes/mkldnn_fusion.py``:
``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per call). Packing
once saves the per-call weight reorder that a plain ``x @ W.T`` pays. The copy is bf16
where the CPU runs bf16 natively and fp32 elsewhere (:func:`multi_row_linear`;
``bench/engine/multirow.py`` measures the choice).

Invariant: every backend computes ``x @ W.T`` for the same ``W`` (up to the activation
rounding of its compute dtype) and returns ``x``'s dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Q4_GROUP = 32
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


@dataclass(slots=True)
class DenseLinear:
    weight: torch.Tensor  # [out, in], contiguous

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return x @ self.weight.t()
        return (x.to(self.weight.dtype) @ self.weight.t()).to(x.dtype)

    def dense(self) -> torch.Tensor:
        return self.weight.float()


@dataclass(slots=True)
class Int4Linear:
    packed: torch.Tensor  # torch CPU int4 pack of q [out, in]
    scales_zeros: torch.Tensor  # [in / 32, out, 2] bf16
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, Q4_GROUP, self.scales_zeros)
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, Q4_GROUP, self.scales_zeros).float().t()


@dataclass(slots=True)
class PackedLinear:
    """Weights packed once for oneDNN in ``dtype`` (bf16 or fp32); ``x``'s dtype out.

    bf16 needs a CPU that runs oneDNN's bf16 kernels natively (:func:`native_bf16`);
    fp32 packing works wherever oneDNN is built in (:func:`packed_supported`).
    """

    packed: torch.Tensor  # layout torch._mkldnn, logical shape [out, in]
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> PackedLinear:
        weight = weight.to(dtype).contiguous()
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight), weight.shape[0], weight.shape[1], dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, None, "none", [], "")
        return y.to(x.dtype)

    def dense(self) -> torch.Tensor:
        return self(torch.eye(self.in_features, dtype=self.dtype)).float().t()


def packed_supported() -> bool:
    """oneDNN is built in (packed fp32 linears work)."""
    return bool(torch.backends.mkldnn.is_available())


def native_bf16() -> bool:
    """oneDNN is built in and this CPU runs its bf16 kernels natively (AVX512-BF16 or AMX)."""
    return packed_supported() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def multi_row_linear(weight: torch.Tensor) -> PackedLinear | DenseLinear:
    """The fastest linear for many rows of ``weight`` ``[out, in]`` on this CPU.

    Packed bf16 where the CPU has native bf16. Elsewhere (e.g. AVX2-only CPUs) bf16 and
    fp16 GEMMs are emulated and 3-7x slower than fp32 (measured on an AVX2 x86_64 host:
    a [1536, 576] matrix at 512 rows, bf16 187 ms, fp32 28.5 ms, packed fp32 25.4 ms; the
    [49152, 576] LM head at 8 rows, bf16 98 ms, packed fp32 23.5 ms), so packed fp32.
    """
    if native_bf16():
        return PackedLinear.from_weight(weight, torch.bfloat16)
    if packed_supported():
        return PackedLinear.from_weight(weight, torch.float32)
    return DenseLinear(weight.float().contiguous())


@dataclass(slots=True)
class RowAdaptiveLinear:
    """One matrix in two layouts; the cheaper one for the number of rows is used.

    Measured on an AVX512-BF16 host (no AMX, memory bandwidth shared), inside a whole
    decode step where the weights stream from memory: up to 4 rows the 4-bit kernel
    wins because it moves the fewest bytes; from 5 rows on it runs twice over the weights
    (its time jumps ~1.6x between 4 and 5 rows) and the packed bf16 GEMM is faster (a
    batch-8 decode step: ~49 ms → ~43 ms); for prefill-sized inputs the bf16 GEMM is 2-3x
    faster than fp32 and than the int4 kernel. On an AVX2-only host (packed fp32 as the
    multi-row copy) the same split holds: whole decode steps of 1 / 2 / 4 / 8 rows took
    73 / 95 / 142 / 258 ms on the 4-bit kernel against 111 / 136 / 159 / 247 ms packed.
    Both compute the same matrix up to bf16 rounding — so, as in GPU engines, a sequence's logits depend slightly on how many
    rows share its step (the ``fp32`` format is the batch-invariant reference).
    """

    single: DenseLinear | Int4Linear  # used when x has at most ``max_single_rows`` rows
    multi: DenseLinear | PackedLinear
    max_single_rows: int = 4

    @property
    def out_features(self) -> int:
        return self.multi.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.single(x) if x.shape[0] <= self.max_single_rows else self.multi(x)

    def dense(self) -> torch.Tensor:
        return self.multi.dense()


Linear = DenseLinear | Int4Linear | PackedLinear | RowAdaptiveLinear


@dataclass(slots=True)
class Q4Rows:
    """A Q4_1 matrix split into nibbles and per-group ``d``/``m`` (rows can be permuted/concatenated)."""

    q: np.ndarray  # [out, in] uint8 in 0..15
    d: np.ndarray  # [out, in / 32] float32
    m: np.ndarray  # [out, in / 32] float32

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> Q4Rows:
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, _Q4_1_BLOCK_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
        q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)  # elements 0..15 low, 16..31 high
        return cls(q.reshape(rows, -1), d, m)

    def take_rows(self, order: np.ndarray) -> Q4Rows:
        return Q4Rows(self.q[order], self.d[order], self.m[order])

    @staticmethod
    def concat(parts: list[Q4Rows]) -> Q4Rows:
        return Q4Rows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))

    def dequantize(self) -> np.ndarray:
        groups = self.q.reshape(self.q.shape[0], -1, Q4_GROUP).astype(np.float32)
        return (groups * self.d[..., None] + self.m[..., None]).reshape(self.q.shape)

    def to_linear(self) -> Int4Linear:
        out_features, in_features = self.q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(self.q.astype(np.int32)), 1)
        scale = torch.from_numpy(self.d).t()
        zero = torch.from_numpy(self.m + 8.0 * self.d).t()
        scales_zeros = torch.stack((scale, zero), dim=-1).to(torch.bfloat16).contiguous()
        return Int4Linear(packed, scales_zeros, out_features, in_features)
