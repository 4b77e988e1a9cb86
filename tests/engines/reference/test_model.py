"""The Llama forward over paged KV: GGUF facts, RoPE layout, chunking and batching invariance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engines.reference.kv_cache import KvDtype, PagedKvCache
from engines.reference.linear import (
    DenseLinear,
    PackedLinear,
    Q4Rows,
    RowAdaptiveLinear,
    multi_row_linear,
    native_bf16,
    packed_supported,
)
from engines.reference.model import DecodeGroup, LlamaModel, PrefillSpan, StepBatch
from engines.reference.weights import unpermute_rope_rows
from tests.engines.reference.helpers import chat_ids


def test_gguf_facts(bundle):
    cfg = bundle.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    weights = bundle.model.weights
    assert weights.lm_head.weight is weights.embed  # tied embeddings: no output.weight in the file
    assert weights.layers[0].wqkv.weight.shape == (576 + 2 * 192, 576)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 8, 5)).astype(np.float32)
    heads = 3
    # llama.cpp convert_hf_to_gguf.LlamaModel.permute
    permuted = weight.reshape(heads, 2, 8 // 2, 5).swapaxes(1, 2).reshape(weight.shape)
    assert np.array_equal(unpermute_rope_rows(permuted, heads), weight)


def _prefill(bundle, cache, ids, *, chunk: int | None = None, offset_slot: int = 0):
    """Prefill ``ids`` at token slots offset_slot.. in chunks; returns last-token logits."""
    n = len(ids)
    slots = torch.arange(offset_slot, offset_slot + n)
    chunk = chunk or n
    logits = None
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        batch = StepBatch(
            torch.tensor(ids[start:stop]), torch.arange(start, stop), slots[start:stop],
            [PrefillSpan(0, stop - start, slots[:stop], start)], logit_rows=torch.tensor([stop - start - 1]),
        )
        logits = bundle.model.forward(batch, cache)
    return logits[0]


def test_chunked_prefill_matches_one_shot(bundle, tokenizer):
    ids = list(chat_ids(tokenizer, "Explain photosynthesis in one paragraph, please, with an example."))
    geometry = bundle.geometry(16)
    whole = _prefill(bundle, PagedKvCache(geometry, KvDtype.FP32, primary_blocks=8), ids)
    chunked = _prefill(bundle, PagedKvCache(geometry, KvDtype.FP32, primary_blocks=8), ids, chunk=7)
    assert torch.allclose(whole, chunked, atol=1e-3)
    assert int(whole.argmax()) == int(chunked.argmax())


def test_batched_prefill_and_decode_match_single_sequences(bundle, tokenizer):
    a = list(chat_ids(tokenizer, "What is the capital of France?"))
    b = list(chat_ids(tokenizer, "Name three colors of the rainbow, please."))
    geometry = bundle.geometry(16)
    solo_a = _prefill(bundle, PagedKvCache(geometry, KvDtype.FP32, primary_blocks=16), a)
    solo_b = _prefill(bundle, PagedKvCache(geometry, KvDtype.FP32, primary_blocks=16), b)
    cache = PagedKvCache(geometry, KvDtype.FP32, primary_blocks=16)
    slots_a, slots_b = torch.arange(len(a)), torch.arange(128, 128 + len(b))
    batch = StepBatch(
        torch.tensor(a + b), torch.cat((torch.arange(len(a)), torch.arange(len(b)))), torch.cat((slots_a, slots_b)),
        [PrefillSpan(0, len(a), slots_a, 0), PrefillSpan(len(a), len(b), slots_b, 0)],
        logit_rows=torch.tensor([len(a) - 1, len(a) + len(b) - 1]),
    )
    both = bundle.model.forward(batch, cache)
    assert torch.allclose(both[0], solo_a, atol=1e-3) and torch.allclose(both[1], solo_b, atol=1e-3)
    # One batched decode step of both sequences (padded contexts) vs each alone.
    next_a, next_b = int(both[0].argmax()), int(both[1].argmax())
    width = max(len(a), len(b)) + 1
    context = torch.zeros(2, width, dtype=torch.int64)
    mask = torch.zeros(2, 1, 1, width, dtype=torch.bool)
    context[0, : len(a) + 1] = torch.arange(len(a) + 1)
    context[1, : len(b) + 1] = torch.arange(128, 128 + len(b) + 1)
    mask[0, ..., : len(a) + 1] = True
    mask[1, ..., : len(b) + 1] = True
    step = StepBatch(
        torch.tensor([next_a, next_b]), torch.tensor([len(a), len(b)]), torch.tensor([len(a), 128 + len(b)]),
        decode=DecodeGroup(0, context, mask), logit_rows=torch.tensor([0, 1]),
    )
    decoded = bundle.model.forward(step, cache)
    single = PagedKvCache(geometry, KvDtype.FP32, primary_blocks=16)
    _prefill(bundle, single, a)
    alone = bundle.model.forward(StepBatch(
        torch.tensor([next_a]), torch.tensor([len(a)]), torch.tensor([len(a)]),
        decode=DecodeGroup(0, torch.arange(len(a) + 1).unsqueeze(0), torch.ones(1, 1, 1, len(a) + 1, dtype=torch.bool)),
        logit_rows=torch.tensor([0]),
    ), single)
    assert torch.allclose(decoded[0], alone[0], atol=1e-3)


def test_wrong_rope_layout_breaks_the_model(bundle, tokenizer):
    """The un-permutation matters: with llama.cpp's row order and rotate_half, EOS comes at once."""
    ids = list(chat_ids(tokenizer, "What is the capital of France?"))
    geometry = bundle.geometry(16)
    good = _prefill(bundle, PagedKvCache(geometry, KvDtype.FP32, primary_blocks=8), ids)
    assert tokenizer.decode([int(good.argmax())]).strip() == "The"
    cfg = bundle.config

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp's permutation, re-applied
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    layers = []
    for layer in bundle.model.weights.layers:
        w = layer.wqkv.weight
        scrambled = torch.cat((permute(w[: cfg.q_size], cfg.num_heads),
                               permute(w[cfg.q_size : cfg.q_size + cfg.kv_size], cfg.num_kv_heads),
                               w[cfg.q_size + cfg.kv_size :]))
        layers.append(dataclasses.replace(layer, wqkv=DenseLinear(scrambled)))
    wrong = LlamaModel(dataclasses.replace(bundle.model.weights, layers=layers))
    cache = PagedKvCache(geometry, KvDtype.FP32, primary_blocks=8)
    slots = torch.arange(len(ids))
    bad = wrong.forward(StepBatch(torch.tensor(ids), slots, slots, [PrefillSpan(0, len(ids), slots, 0)],
                                  logit_rows=torch.tensor([len(ids) - 1])), cache)[0]
    assert int(bad.argmax()) != int(good.argmax())


def test_e4m3_scales_are_calibrated_per_layer(bundle):
    scales = bundle.kv_scales(KvDtype.FP8_E4M3)
    assert scales.shape == (30,) and (scales > 0).all()
    assert len(set(scales.tolist())) > 1  # per layer, not one global constant
    assert torch.equal(bundle.kv_scales(KvDtype.FP8_E5M2), torch.ones(30))


def test_q4_rows_reproduce_gguf_dequantization_and_the_int4_kernel_matches(bundle):
    from gguf.quants import dequantize

    from engines.reference.weights import open_gguf

    reader = open_gguf(bundle.path)
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    rows = Q4Rows.from_gguf(np.asarray(tensor.data))
    reference = dequantize(tensor.data, tensor.tensor_type)
    assert np.array_equal(rows.dequantize(), reference)
    linear = rows.to_linear()
    x = torch.randn(3, reference.shape[1])
    expected = x @ torch.from_numpy(reference).t()
    # bf16 activations and scales: relative error of a few 1e-3
    assert torch.allclose(linear(x), expected, rtol=0.02, atol=0.02 * expected.abs().max().item())


@pytest.mark.parametrize("cached,n", [(1, 1), (40, 7), (96, 64)])
def test_split_prefix_attention_equals_masked_attention(cached, n):
    import torch.nn.functional as F

    from engines.reference.model import _attend_after_prefix

    torch.manual_seed(cached + n)
    heads, kv_heads, d = 9, 3, 64
    queries = torch.randn(1, n, heads, d).transpose(1, 2)  # non-contiguous, as in the forward
    keys = torch.randn(1, cached + n, kv_heads, d).transpose(1, 2)
    values = torch.randn(1, cached + n, kv_heads, d).transpose(1, 2)
    mask = torch.arange(cached + n)[None, :] <= torch.arange(cached, cached + n)[:, None]
    expected = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(_attend_after_prefix(queries, keys, values, cached, heads // kv_heads), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_the_dense_product(dtype):
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("oneDNN bf16 kernels unavailable on this CPU (fp32 packing is tested instead)")
    if not packed_supported():
        pytest.skip("torch built without oneDNN")
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=gen)
    packed = PackedLinear.from_weight(weight, dtype)
    exact = weight.to(dtype).float()  # the matrix the packed kernel multiplies by
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, generator=gen)
        expected = x.to(dtype).float() @ exact.t()
        got = packed(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    assert torch.allclose(packed.dense(), exact, atol=1e-6)


def test_multi_row_linear_packs_in_the_cpus_fast_dtype():
    linear = multi_row_linear(torch.randn(16, 32))
    if native_bf16():
        assert isinstance(linear, PackedLinear) and linear.dtype == torch.bfloat16
    elif packed_supported():
        # bf16/fp16 GEMMs are emulated without native bf16: fp32 is several times faster.
        assert isinstance(linear, PackedLinear) and linear.dtype == torch.float32
    else:
        assert isinstance(linear, DenseLinear) and linear.weight.dtype == torch.float32


def test_row_adaptive_linear_uses_int4_up_to_4_rows_then_the_packed_gemm():
    gen = torch.Generator().manual_seed(7)
    # The row-adaptive pairing: 4-bit kernel up to 4 rows, the multi-row GEMM from 5 rows on.
    q = torch.randint(0, 16, (96, 64), generator=gen).numpy().astype("uint8")
    d = (torch.rand(96, 2, generator=gen) * 0.01).numpy()
    m = (torch.rand(96, 2, generator=gen) * -0.05).numpy()
    rows4 = Q4Rows(q, d, m)
    adaptive = RowAdaptiveLinear(rows4.to_linear(), multi_row_linear(torch.from_numpy(rows4.dequantize())))
    calls = []
    for name in ("single", "multi"):
        inner = getattr(adaptive, name)
        setattr(adaptive, name, lambda x, inner=inner, name=name: calls.append(name) or inner(x))
    reference = torch.from_numpy(rows4.dequantize())
    for rows in (1, 4, 5, 8):
        x = torch.randn(rows, 64, generator=gen)
        expected = x @ reference.t()
        assert torch.allclose(adaptive(x), expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert calls == ["single", "single", "multi", "multi"]
