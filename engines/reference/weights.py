"""Load a Llama-architecture GGUF into dequantized torch tensors.

The GGUF is read with the ``gguf`` package (``GGUFReader`` + ``gguf.quants.dequantize``);
every tensor is copied out of the read-only memory map. Two conversions undo what
llama.cpp's ``convert_hf_to_gguf.py`` did to a Hugging Face Llama checkpoint:

* ``attn_q`` / ``attn_k`` rows were permuted so RoPE can rotate *adjacent* pairs
  (``LlamaModel.permute``: ``w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)``). We apply the
  inverse permutation so the forward can use the Hugging Face ``rotate_half`` form.
  Using the permuted rows with ``rotate_half`` scrambles positions and the model answers
  with EOS at once.
* Tied embeddings: there is no ``output.weight``; the LM head is ``token_embd.weight``.

Invariant: after :func:`load_llama_gguf`, ``LlamaWeights`` holds writable linears
(:mod:`engines.reference.linear`) in the Hugging Face row order, with Q/K/V fused into
one ``[q + 2*kv, hidden]`` matrix and gate/up fused into one ``[2*ffn, hidden]`` matrix
(one matmul each instead of three and two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engines.reference.linear import DenseLinear, Linear, Q4Rows, RowAdaptiveLinear, multi_row_linear


class ModelLoadError(RuntimeError):
    """The GGUF is missing, unreadable, or not a Llama model we can run."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Linear  # [q + 2 kv, hidden]
    wo: Linear  # [hidden, q]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: Linear  # [2 ffn, hidden]
    w_down: Linear  # [hidden, ffn]


@dataclass(slots=True)
class LlamaWeights:
    config: LlamaConfig
    embed: torch.Tensor  # [vocab, hidden], the activation dtype
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear  # [vocab, hidden]; wraps the embedding when tied
    weight_format: str = "fp32"


def _meta(reader: GGUFReader, key: str):
    entry = reader.fields.get(key)
    if entry is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return entry.contents()


def read_config(reader: GGUFReader) -> LlamaConfig:
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"only the 'llama' architecture is supported, got {arch!r}")
    hidden = int(_meta(reader, "llama.embedding_length"))
    heads = int(_meta(reader, "llama.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(reader.fields["llama.vocab_size"].contents()) if "llama.vocab_size" in reader.fields else len(tokens.data)
    return LlamaConfig(
        num_layers=int(_meta(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, "llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        rope_theta=float(_meta(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        max_position=int(_meta(reader, "llama.context_length")),
    )


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on Q/K projection rows."""
    return weight[rope_row_order(weight.shape[0], num_heads)]


def rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Row indices that undo llama.cpp's permutation: ``unpermuted = permuted[order]``."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


def open_gguf(path: str | Path) -> GGUFReader:
    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    try:
        return GGUFReader(gguf_path)
    except Exception as exc:  # gguf raises assorted errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc


WEIGHT_FORMATS = ("fp32", "bf16", "q4")


def load_llama_gguf(reader: GGUFReader, *, weight_format: str = "fp32") -> LlamaWeights:
    """Load every tensor of a Llama GGUF (see the module docstring).

    ``weight_format``: ``fp32`` (dequantized, fp32 activations — the exact reference),
    ``bf16`` (dequantized to bf16, bf16 activations), ``q4`` (the fast path: Q4_1
    matrices kept 4-bit for steps of up to 4 rows plus packed copies for larger ones, see
    :class:`~engines.reference.linear.RowAdaptiveLinear`; fp32 residual stream).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ModelLoadError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    config = read_config(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    dtype = torch.bfloat16 if weight_format == "bf16" else torch.float32

    def tensor(name: str):
        try:
            return tensors[name]
        except KeyError as exc:
            raise ModelLoadError(f"GGUF lacks tensor {name!r}") from exc

    def dense(name: str) -> np.ndarray:
        item = tensor(name)
        # np.array(copy=True): F32 tensors come back as read-only memmaps.
        return np.array(dequantize(item.data, item.tensor_type), dtype=np.float32, copy=True)

    def to_torch(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype).contiguous()

    def linear(parts: list[tuple[str, int | None]]) -> Linear:
        """Rows of the named matrices stacked; ``heads`` set = undo the RoPE row permutation."""
        quantized = weight_format == "q4" and all(tensor(n).tensor_type == GGMLQuantizationType.Q4_1 for n, _ in parts)
        if quantized:
            rows = []
            for name, heads in parts:
                q4 = Q4Rows.from_gguf(np.asarray(tensor(name).data))
                rows.append(q4.take_rows(rope_row_order(q4.q.shape[0], heads)) if heads else q4)
            merged = Q4Rows.concat(rows)
            return RowAdaptiveLinear(merged.to_linear(), multi_row_linear(torch.from_numpy(merged.dequantize())))
        arrays = []
        for name, heads in parts:
            array = dense(name)
            arrays.append(array[rope_row_order(array.shape[0], heads)] if heads else array)
        return DenseLinear(to_torch(np.concatenate(arrays, axis=0)))

    layers = []
    for i in range(config.num_layers):
        layers.append(
            LayerWeights(
                attn_norm=to_torch(dense(f"blk.{i}.attn_norm.weight")),
                wqkv=linear([(f"blk.{i}.attn_q.weight", config.num_heads), (f"blk.{i}.attn_k.weight", config.num_kv_heads),
                             (f"blk.{i}.attn_v.weight", None)]),
                wo=linear([(f"blk.{i}.attn_output.weight", None)]),
                ffn_norm=to_torch(dense(f"blk.{i}.ffn_norm.weight")),
                w_gate_up=linear([(f"blk.{i}.ffn_gate.weight", None), (f"blk.{i}.ffn_up.weight", None)]),
                w_down=linear([(f"blk.{i}.ffn_down.weight", None)]),
            )
        )
    embed = to_torch(dense("token_embd.weight"))
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(f"token_embd.weight has shape {tuple(embed.shape)}, expected {(config.vocab_size, config.hidden_size)}")
    head = to_torch(dense("output.weight")) if "output.weight" in tensors else embed
    lm_head: Linear = DenseLinear(head)
    if weight_format == "q4":
        # The tied head (Q8_0 here) is 1/5 of all weights: fp16 has the fastest single-row
        # kernel (on AVX512-BF16 and on AVX2 hosts alike), the packed GEMM the fastest
        # multi-row one (half the time of an unpacked bf16 ``x @ W.T`` at 8 rows).
        lm_head = RowAdaptiveLinear(DenseLinear(head.half().contiguous()), multi_row_linear(head), max_single_rows=1)
    return LlamaWeights(config, embed, layers, to_torch(dense("output_norm.weight")), lm_head, weight_format)
