"""Llama forward in plain torch over a paged KV cache, for mixed prefill/decode batches.

One call to :meth:`LlamaModel.forward` runs one scheduler step: the new tokens of every
scheduled sequence are packed into one ``[T]`` vector (so every projection is one
matmul over all of them), their K/V are written into the cache at their token slots,
and attention reads each sequence's whole context back *from the cache* — so a
sequence attends to exactly the (possibly FP8-rounded) values a later request reusing
those blocks will read, and cold and warm runs see the same numbers.

Attention layout::

    prefill sequence i:  q [1, H, n_i, d]   k/v [1, Hkv, ctx_i, d]   causal, offset by the cached prefix
    decode group:        q [B, Hkv, G, d]   k/v [B, Hkv, L, d]       G = H / Hkv query heads per KV head,
                                                                     L = longest context, padding masked

``scaled_dot_product_attention`` always gets 4-D tensors (3-D inputs fall to a path
several times slower on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engines.reference.kv_cache import PagedKvCache
from engines.reference.weights import LlamaConfig, LlamaWeights


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prompt chunk inside the packed token vector."""

    start: int  # first row in the packed vector
    length: int  # number of new tokens
    context_slots: torch.Tensor  # [ctx] token slots of the whole context (cached + new), in order
    cached: int  # tokens before the chunk (already in the cache)


@dataclass(slots=True)
class DecodeGroup:
    """Sequences decoding one token each; their rows are ``start .. start + B``."""

    start: int
    context_slots: torch.Tensor  # [B, L] padded with any valid slot
    mask: torch.Tensor  # [B, 1, 1, L] bool, True = attend


@dataclass(slots=True)
class StepBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64 token slots in the primary tier
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode: DecodeGroup | None = None
    logit_rows: torch.Tensor | None = None  # rows whose next-token logits are wanted


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class LlamaModel:
    """Stateless forward over :class:`LlamaWeights`; all state lives in the KV cache."""

    def __init__(self, weights: LlamaWeights) -> None:
        self.weights = weights
        self.config: LlamaConfig = weights.config
        cfg = self.config
        self.dtype = weights.embed.dtype
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self._cos = angles.cos().to(self.dtype)
        self._sin = angles.sin().to(self.dtype)
        self.groups = cfg.num_heads // cfg.num_kv_heads

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: PagedKvCache) -> torch.Tensor:
        """Run one step; returns logits ``[len(logit_rows), vocab]`` (float32)."""
        cfg, w = self.config, self.weights
        heads, kv_heads, d, groups = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.groups
        q_size, kv_size, half = cfg.q_size, cfg.kv_size, cfg.head_dim // 2
        x = w.embed.index_select(0, batch.token_ids)
        total = x.shape[0]
        # Q and K heads are rotated together: [T, heads + kv_heads, d].
        cos = self._cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self._sin.index_select(0, batch.positions).unsqueeze(1)
        decode = batch.decode
        # A lone decode row needs no padding mask (its context is exactly its slots).
        decode_mask = None if decode is None or decode.context_slots.shape[0] == 1 else decode.mask
        eps = cfg.rms_norm_eps
        for layer_index, layer in enumerate(w.layers):
            qkv = layer.wqkv(rms_norm(x, layer.attn_norm, eps))  # [T, q | k | v]
            qk = qkv[:, : q_size + kv_size].view(total, heads + kv_heads, d)
            rotated = torch.cat((qk[..., half:].neg(), qk[..., :half]), dim=-1)
            # RoPE written back in place, so qkv[:, q_size:] is the [T, k | v] row the cache stores.
            torch.addcmul(qk * cos, rotated, sin, out=qk)
            cache.write(layer_index, qkv[:, q_size:], batch.write_slots)
            q = qkv[:, :q_size]
            attn = torch.empty(total, q_size, dtype=x.dtype)
            for span in batch.prefills:
                kv = cache.read(layer_index, span.context_slots)  # [ctx, k | v]
                ctx = kv.shape[0]
                keys = kv[:, :kv_size].view(1, ctx, kv_heads, d).transpose(1, 2)
                values = kv[:, kv_size:].view(1, ctx, kv_heads, d).transpose(1, 2)
                queries = q[span.start : span.start + span.length].view(1, span.length, heads, d).transpose(1, 2)
                if span.cached == 0:
                    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
                else:
                    out = _attend_after_prefix(queries, keys, values, span.cached, groups)
                attn[span.start : span.start + span.length] = out.transpose(1, 2).reshape(span.length, q_size)
            if decode is not None:
                rows, width = decode.context_slots.shape
                kv = cache.read(layer_index, decode.context_slots)  # [B, L, k | v]
                keys = kv[..., :kv_size].view(rows, width, kv_heads, d).transpose(1, 2)
                values = kv[..., kv_size:].view(rows, width, kv_heads, d).transpose(1, 2)
                # GQA without copies: a KV head's query heads act as G query positions.
                queries = q[decode.start : decode.start + rows].view(rows, kv_heads, groups, d)
                out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decode_mask)
                attn[decode.start : decode.start + rows] = out.reshape(rows, q_size)
            x = x + layer.wo(attn)
            gate_up = layer.w_gate_up(rms_norm(x, layer.ffn_norm, eps))
            gate, up = gate_up.split(cfg.intermediate_size, dim=-1)
            x = x + layer.w_down(F.silu(gate) * up)
        rows = batch.logit_rows if batch.logit_rows is not None else torch.arange(total)
        if rows.numel() == 0:  # a step of unfinished prefill chunks samples nothing
            return torch.empty(0, cfg.vocab_size)
        hidden = rms_norm(x.index_select(0, rows), w.final_norm, eps)
        return w.lm_head(hidden).float()


_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_after_prefix(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int, groups: int
) -> torch.Tensor:
    """Causal attention of a chunk that follows ``cached`` context tokens, without a mask.

    Split in two flash-attention calls merged by their log-sum-exps: the chunk against the
    cached prefix (every query sees every key: no mask, and GQA by folding each KV head's
    query heads into the query axis) and the chunk against itself (plain causal). A boolean
    mask over the whole context made the CPU kernel 10-25 % slower than this.
    ``queries`` [1, H, n, d], ``keys``/``values`` [1, Hkv, cached + n, d] -> [1, H, n, d].
    """
    _, heads, n, d = queries.shape
    kv_heads = keys.shape[1]
    folded = queries.reshape(1, kv_heads, groups * n, d)  # head h = kv_head * groups + g
    prefix_out, prefix_lse = _flash_with_lse(folded, keys[:, :, :cached], values[:, :, :cached], 0.0, False)
    own_keys = keys[:, :, cached:].repeat_interleave(groups, dim=1)
    own_values = values[:, :, cached:].repeat_interleave(groups, dim=1)
    own_out, own_lse = _flash_with_lse(queries, own_keys, own_values, 0.0, True)
    prefix_out = prefix_out.reshape(1, heads, n, d)
    prefix_lse = prefix_lse.reshape(1, heads, n)
    total = torch.logaddexp(prefix_lse, own_lse)
    return prefix_out * (prefix_lse - total).exp_().unsqueeze(-1) + own_out * (own_lse - total).exp_().unsqueeze(-1)
