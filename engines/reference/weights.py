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

Invariant: after :func:`load_llama_gguf`, ``LlamaWeights`` holds contiguous, writable
tensors in the requested dtype, in the Hugging Face row order, with Q/K/V fused into
one ``[q + 2*kv, hidden]`` matrix and gate/up fused into one ``[2*ffn, hidden]`` matrix
(one matmul each instead of three and two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize


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
    wqkv: torch.Tensor  # [q + 2 kv, hidden]
    wo: torch.Tensor  # [hidden, q]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]


@dataclass(slots=True)
class LlamaWeights:
    config: LlamaConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied


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
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def open_gguf(path: str | Path) -> GGUFReader:
    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    try:
        return GGUFReader(gguf_path)
    except Exception as exc:  # gguf raises assorted errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF {gguf_path}: {exc}") from exc


def load_llama_gguf(reader: GGUFReader, *, dtype: torch.dtype = torch.float32) -> LlamaWeights:
    """Dequantize every tensor of a Llama GGUF (see the module docstring)."""
    config = read_config(reader)
    arrays: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        # np.array(copy=True): F32 tensors come back as read-only memmaps.
        arrays[tensor.name] = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)

    def take(name: str) -> np.ndarray:
        try:
            return arrays.pop(name)
        except KeyError as exc:
            raise ModelLoadError(f"GGUF lacks tensor {name!r}") from exc

    def to_torch(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        wq = unpermute_rope_rows(take(f"blk.{i}.attn_q.weight"), config.num_heads)
        wk = unpermute_rope_rows(take(f"blk.{i}.attn_k.weight"), config.num_kv_heads)
        wv = take(f"blk.{i}.attn_v.weight")
        gate, up = take(f"blk.{i}.ffn_gate.weight"), take(f"blk.{i}.ffn_up.weight")
        layers.append(
            LayerWeights(
                attn_norm=to_torch(take(f"blk.{i}.attn_norm.weight")),
                wqkv=to_torch(np.concatenate([wq, wk, wv], axis=0)),
                wo=to_torch(take(f"blk.{i}.attn_output.weight")),
                ffn_norm=to_torch(take(f"blk.{i}.ffn_norm.weight")),
                w_gate_up=to_torch(np.concatenate([gate, up], axis=0)),
                w_down=to_torch(take(f"blk.{i}.ffn_down.weight")),
            )
        )
    embed = to_torch(take("token_embd.weight"))
    lm_head = to_torch(arrays.pop("output.weight")) if "output.weight" in arrays else embed
    weights = LlamaWeights(config, embed, layers, to_torch(take("output_norm.weight")), lm_head)
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(f"token_embd.weight has shape {tuple(embed.shape)}, expected {(config.vocab_size, config.hidden_size)}")
    return weights
