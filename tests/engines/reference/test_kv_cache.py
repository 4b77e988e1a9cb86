"""Paged KV tiers: quantization rules per dtype and bitwise block copies."""

from __future__ import annotations

import pytest
import torch

from engines.reference.kv_cache import KvDtype, KvGeometry, PagedKvCache

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=3, head_dim=4, tokens_per_block=4)


def make(dtype: KvDtype, scales=None) -> PagedKvCache:
    return PagedKvCache(GEOMETRY, dtype, primary_blocks=4, secondary_blocks=3, scales=scales)


@pytest.mark.parametrize("dtype", list(KvDtype))
def test_read_returns_what_write_stored(dtype):
    cache = make(dtype, torch.tensor([0.01, 0.02]))
    torch.manual_seed(0)
    rows = torch.randn(5, 24)  # [K heads | V heads] per token
    slots = torch.tensor([0, 1, 2, 9, 10])
    cache.write(1, rows, slots)
    read = cache.read(1, slots)
    expected = cache.dequantize(1, cache.quantize(1, rows))
    assert torch.equal(read, expected)
    tolerance = {KvDtype.FP32: 0.0, KvDtype.FP16: 2e-3, KvDtype.BF16: 2e-2, KvDtype.FP8_E4M3: 0.07, KvDtype.FP8_E5M2: 0.13}[dtype]
    assert torch.allclose(read, rows, rtol=tolerance, atol=tolerance * 0.1 + 1e-6)


def test_e4m3_uses_the_per_layer_scale_and_clamps():
    cache = make(KvDtype.FP8_E4M3, torch.tensor([1.0, 0.5]))
    big = torch.cat((torch.full((1, 12), 1000.0), torch.full((1, 12), -1000.0)), dim=1)
    cache.write(1, big, torch.tensor([0]))
    read = cache.read(1, torch.tensor([0]))
    assert torch.equal(read[:, :12], torch.full((1, 12), 448.0 * 0.5))  # clamped to E4M3 max, times the scale
    assert torch.equal(read[:, 12:], torch.full((1, 12), -448.0 * 0.5))
    assert cache.primary.dtype == torch.float8_e4m3fn


def test_e5m2_clamps_instead_of_overflowing_to_inf():
    cache = make(KvDtype.FP8_E5M2)
    cache.write(0, torch.full((1, 24), 1e6), torch.tensor([3]))
    read = cache.read(0, torch.tensor([3]))
    assert torch.isfinite(read).all() and read.max() == 57344.0


@pytest.mark.parametrize("dtype", [KvDtype.FP8_E4M3, KvDtype.BF16])
def test_offload_and_onboard_copy_bytes_exactly(dtype):
    cache = make(dtype, torch.tensor([0.05, 0.05]))
    cache.write(0, torch.randn(4, 24), torch.arange(4, 8))  # block 1
    cache.write(1, torch.randn(4, 24), torch.arange(4, 8))
    original = cache.block_bytes(0, 1)
    cache.copy_block(0, 1, 1, 2)  # offload primary 1 -> secondary 2
    assert torch.equal(cache.block_bytes(1, 2).view(torch.uint8), original.view(torch.uint8))
    cache.write(0, torch.zeros(4, 24), torch.arange(4, 8))  # slot reused by someone else
    cache.copy_block(1, 2, 0, 3)  # onboard secondary 2 -> primary 3
    assert torch.equal(cache.block_bytes(0, 3).view(torch.uint8), original.view(torch.uint8))


def test_sizes_follow_the_dtype():
    assert make(KvDtype.FP8_E4M3).nbytes() == (2 * 16 * 24, 2 * 12 * 24)
    assert make(KvDtype.FP32).nbytes()[0] == 4 * 2 * 2 * 16 * 12
    assert GEOMETRY.bytes_per_block(KvDtype.FP16) == 2 * 2 * 4 * 12 * 2


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="primary_blocks"):
        PagedKvCache(GEOMETRY, KvDtype.FP32, primary_blocks=0)


def test_e4m3_bit_dequantization_matches_the_cast_for_every_code():
    cache = make(KvDtype.FP8_E4M3, torch.tensor([1.0, 0.25]))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN in E4M3FN; clamping never stores them
    stored = finite.view(torch.float8_e4m3fn)
    assert torch.equal(cache.dequantize(1, stored), stored.float() * 0.25)
