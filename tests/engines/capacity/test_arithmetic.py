"""kvgate plan's arithmetic against figures computed by hand from each shipped config.json.

Each expected number is written out as the hand calculation (fields of the model's
config.json), independently of engines/capacity; the published parameter counts
(8.03B, 70.6B, 72.7B, 671B, 141B, 235B, 30.5B) confirm the hand arithmetic itself.
"""

from __future__ import annotations

import json

import pytest

from engines.capacity.arithmetic import (PlanError, PlanInputs, count_params, host_cache_size_for_blocks,
                                         kv_bytes_per_token, kv_bytes_per_token_per_rank, plan, weight_bytes)
from engines.capacity.hardware import GIB, MIB, Hardware, HardwareError, load_gpu
from engines.capacity.shapes import ShapeError, bundled_shape_names, load_shape, shape_from_config

SHIPPED = ["deepseek-v3", "llama-3.1-405b", "llama-3.1-70b", "llama-3.1-8b", "mixtral-8x22b", "qwen2.5-72b",
           "qwen3-235b-a22b", "qwen3-30b-a3b"]


def test_every_shipped_shape_is_listed_with_its_source() -> None:
    assert bundled_shape_names() == SHIPPED
    for name in SHIPPED:
        assert load_shape(name).source.startswith("https://huggingface.co/") and name  # cites its config.json


# --- KV bytes per token (BF16 = 2 bytes; FP8 = 1) ------------------------------------------------
KV_BF16 = {
    # layers × 2 (K and V) × kv heads × head_dim × 2 bytes
    "llama-3.1-8b": 32 * 2 * 8 * 128 * 2,  # 131,072
    "llama-3.1-70b": 80 * 2 * 8 * 128 * 2,  # 327,680
    "llama-3.1-405b": 126 * 2 * 8 * 128 * 2,  # 516,096
    "qwen2.5-72b": 80 * 2 * 8 * 128 * 2,  # 327,680 (head_dim = 8192 / 64)
    "mixtral-8x22b": 56 * 2 * 8 * 128 * 2,  # 229,376 (head_dim = 6144 / 48)
    "qwen3-235b-a22b": 94 * 2 * 4 * 128 * 2,  # 192,512 (head_dim given: 128)
    "qwen3-30b-a3b": 48 * 2 * 4 * 128 * 2,  # 98,304
    # MLA: layers × (kv_lora_rank + qk_rope_head_dim) × 2 bytes — one latent, no K/V pair, no heads
    "deepseek-v3": 61 * (512 + 64) * 2,  # 70,272
}


@pytest.mark.parametrize("name", SHIPPED)
def test_kv_bytes_per_token(name: str) -> None:
    shape = load_shape(name)
    assert kv_bytes_per_token(shape, "bf16") == KV_BF16[name]
    assert kv_bytes_per_token(shape, "fp16") == KV_BF16[name]
    assert kv_bytes_per_token(shape, "fp8") * 2 == KV_BF16[name]


def test_attention_kinds() -> None:
    assert load_shape("deepseek-v3").attention == "mla"
    assert {load_shape(n).attention for n in SHIPPED if n != "deepseek-v3"} == {"gqa"}
    mha = shape_from_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "vocab_size": 10, "intermediate_size": 128}, name="tiny")
    assert mha.attention == "mha" and mha.num_kv_heads == 4 and mha.head_dim == 16  # transformers' defaults
    assert kv_bytes_per_token(mha, "fp16") == 2 * 2 * 4 * 16 * 2


# --- parameters ---------------------------------------------------------------------------------
def _dense_gqa(*, h, layers, heads, kv, d, inter, vocab, bias=False, qk_norm=False, experts=0, expert_inter=0):
    attention = h * heads * d + 2 * h * kv * d + heads * d * h  # q, k, v, o
    small = 2 * h + (heads * d + 2 * kv * d if bias else 0) + (2 * d if qk_norm else 0)
    if experts:
        mlp = experts * 3 * h * expert_inter + h * experts  # all experts (gate/up/down) + router
    else:
        mlp = 3 * h * inter  # gate, up, down
    return layers * (attention + small + mlp) + 2 * vocab * h + h  # + embedding, untied lm_head, final norm


PARAMS = {
    "llama-3.1-8b": _dense_gqa(h=4096, layers=32, heads=32, kv=8, d=128, inter=14336, vocab=128256),
    "llama-3.1-70b": _dense_gqa(h=8192, layers=80, heads=64, kv=8, d=128, inter=28672, vocab=128256),
    "llama-3.1-405b": _dense_gqa(h=16384, layers=126, heads=128, kv=8, d=128, inter=53248, vocab=128256),
    "qwen2.5-72b": _dense_gqa(h=8192, layers=80, heads=64, kv=8, d=128, inter=29568, vocab=152064, bias=True),
    "mixtral-8x22b": _dense_gqa(h=6144, layers=56, heads=48, kv=8, d=128, inter=0, vocab=32768, experts=8,
                                expert_inter=16384),
    "qwen3-235b-a22b": _dense_gqa(h=4096, layers=94, heads=64, kv=4, d=128, inter=0, vocab=151936, qk_norm=True,
                                  experts=128, expert_inter=1536),
    "qwen3-30b-a3b": _dense_gqa(h=2048, layers=48, heads=32, kv=4, d=128, inter=0, vocab=151936, qk_norm=True,
                                experts=128, expert_inter=768),
}
# DeepSeek-V3, MLA + MoE, written out:
#   attention per layer: q_a 7168×1536 + q_b 1536×128×(128+64) + kv_a 7168×(512+64) + kv_b 512×128×(128+128)
#                        + o 128×128×7168 = 11,010,048 + 37,748,736 + 4,128,768 + 16,777,216 + 117,440,512
_DSV3_ATTENTION = 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512  # 187,105,280
_DSV3_NORMS = 2 * 7168 + 1536 + 512  # input/post norms, q_a_layernorm, kv_a_layernorm
_DSV3_DENSE_MLP = 3 * 7168 * 18432  # first_k_dense_replace = 3 layers
_DSV3_MOE = 256 * 3 * 7168 * 2048 + 1 * 3 * 7168 * 2048 + 7168 * 256 + 256  # routed + shared + router + score bias
PARAMS["deepseek-v3"] = (61 * (_DSV3_ATTENTION + _DSV3_NORMS) + 3 * _DSV3_DENSE_MLP + 58 * _DSV3_MOE
                         + 2 * 129280 * 7168 + 7168)
PUBLISHED_B = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "qwen2.5-72b": 72.7,
               "mixtral-8x22b": 141, "qwen3-235b-a22b": 235, "qwen3-30b-a3b": 30.5, "deepseek-v3": 671}


@pytest.mark.parametrize("name", SHIPPED)
def test_parameter_count(name: str) -> None:
    assert count_params(load_shape(name)).total == PARAMS[name]
    assert PARAMS[name] / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.005)


def test_deepseek_v3_hand_total() -> None:
    assert PARAMS["deepseek-v3"] == 671_026_419_200


def test_moe_weights_hold_every_expert() -> None:
    mixtral = load_shape("mixtral-8x22b")
    params = count_params(mixtral)
    assert params.routed_experts == 56 * 8 * 3 * 6144 * 16384  # all 8 experts, though 2 are active per token
    # FP8 weights: linear layers 1 byte, embeddings/lm_head/router/norms 2 bytes
    unquantized = 2 * 32768 * 6144 + 56 * (6144 * 8 + 2 * 6144) + 6144
    assert weight_bytes(mixtral, "fp8") == (PARAMS["mixtral-8x22b"] - unquantized) + 2 * unquantized
    assert weight_bytes(mixtral, "bf16") == 2 * PARAMS["mixtral-8x22b"]


# --- the plan: TensorRT-LLM's sizing ------------------------------------------------------------
H200 = 143771 * MIB  # nvidia-smi total


def test_plan_qwen72b_fp8_on_8_h200_with_256gib_host() -> None:
    shape = load_shape("qwen2.5-72b")
    p = plan(shape, Hardware(load_gpu("h200"), 8, 8, 1, host_cache_size=256 * GIB // 8),
             PlanInputs(kv_dtype="fp8", weight_dtype="fp8", tokens_per_block=32, free_gpu_memory_fraction=0.9,
                        runtime_reserve_bytes=4 * GIB, context_length=8192))
    unquantized = 2 * 152064 * 8192 + 80 * (2 * 8192 + 8192 + 2 * 1024) + 8192  # embeddings + norms + qkv biases
    weights = (PARAMS["qwen2.5-72b"] - unquantized) * 1 + unquantized * 2
    assert p.weight_bytes == weights == 75_199_758_336
    per_rank_weights = -(-weights // 8)
    free = H200 - per_rank_weights - 4 * GIB
    assert p.free_bytes_per_rank == free
    per_token_rank = 80 * 2 * (8 // 8) * 128 * 1  # one KV head per rank at TP 8, FP8
    assert p.kv_bytes_per_token_per_rank == per_token_rank == 20_480
    assert p.kv_bytes_per_token_per_replica == 8 * 20_480 == p.kv_bytes_per_token  # GQA 8 heads over 8 ranks: no copy
    tokens = int(free * 0.9) // per_token_rank
    assert p.primary_tokens == tokens == 6_023_139
    assert p.primary_blocks == -(-tokens // 32) == 188_224  # ceilDiv, as calculateMaxNumBlocks
    assert p.secondary_blocks == (32 * GIB // per_token_rank) // 32 == 52_428
    assert p.host_bytes_per_replica == 256 * GIB
    assert p.concurrent_sequences == 188_224 // (8192 // 32) == 735
    assert p.registration() == {"tokens_per_block": 32, "primary_blocks": 188_224, "secondary_blocks": 52_428}
    assert p.spec_values()["kv_cache"] == {"free_gpu_memory_fraction": 0.9, "host_cache_size_per_rank": 32 * GIB}


def test_plan_deepseek_v3_mla_latent_is_replicated_over_tp() -> None:
    shape = load_shape("deepseek-v3")
    p = plan(shape, Hardware(load_gpu("h200"), 8, 8), PlanInputs(kv_dtype="fp8", weight_dtype="fp8", runtime_reserve_bytes=8 * GIB))
    assert p.kv_bytes_per_token == 61 * 576 == 35_136
    assert p.kv_bytes_per_token_per_rank == 35_136  # every rank holds the whole latent
    assert p.kv_bytes_per_token_per_replica == 8 * 35_136
    unquantized = 2 * 129280 * 7168 + 61 * _DSV3_NORMS + 7168 + 58 * (7168 * 256 + 256)
    weights = (PARAMS["deepseek-v3"] - unquantized) + 2 * unquantized
    assert p.weight_bytes == weights
    free = H200 - -(-weights // 8) - 8 * GIB
    assert p.primary_blocks == -(-(int(free * 0.9) // 35_136) // 32)
    assert any("replicated" in note for note in p.notes)


def test_plan_mixtral_moe_bf16_on_8_h100() -> None:
    p = plan(load_shape("mixtral-8x22b"), Hardware(load_gpu("h100-80gb"), 16, 8),
             PlanInputs(kv_dtype="fp8", weight_dtype="bf16", runtime_reserve_bytes=4 * GIB, context_length=32768))
    assert p.replicas == 2
    free = 81559 * MIB - -(-2 * PARAMS["mixtral-8x22b"] // 8) - 4 * GIB
    per_token_rank = 56 * 2 * 1 * 128  # FP8, one of 8 KV heads per rank
    assert p.primary_blocks == -(-(int(free * 0.9) // per_token_rank) // 32)
    assert p.concurrent_sequences == p.primary_blocks // 1024


def test_kv_heads_fewer_than_tp_are_replicated() -> None:
    shape = load_shape("qwen3-235b-a22b")  # 4 KV heads
    assert kv_bytes_per_token_per_rank(shape, "fp8", tp=8, pp=1) == 94 * 2 * 1 * 128
    p = plan(shape, Hardware(load_gpu("b200"), 8, 8), PlanInputs(weight_dtype="fp8"))
    assert p.kv_bytes_per_token_per_replica == 2 * p.kv_bytes_per_token
    assert kv_bytes_per_token_per_rank(shape, "fp8", tp=2, pp=2) == 47 * 2 * 2 * 128  # PP halves the layers


def test_host_blocks_reverse() -> None:
    p = plan(load_shape("llama-3.1-8b"), Hardware(load_gpu("l40s"), 1), PlanInputs())
    size = host_cache_size_for_blocks(10_000, p.block_bytes_per_rank)
    assert size == 10_000 * 32 * (32 * 2 * 8 * 128)  # blocks × tokens × FP8 bytes/token
    again = plan(load_shape("llama-3.1-8b"), Hardware(load_gpu("l40s"), 1, host_cache_size=size), PlanInputs())
    assert again.secondary_blocks == 10_000


def test_sequences_need() -> None:
    p = plan(load_shape("llama-3.1-70b"), Hardware(load_gpu("h200"), 8, 8),
             PlanInputs(kv_dtype="bf16", context_length=131072, sequences=256))
    assert p.kv_bytes_for_sequences == 256 * 131072 * 327_680 == 10 * 2**40  # 10 TiB, not "close to 1 TB"


def test_impossible_inputs_are_refused() -> None:
    with pytest.raises(PlanError, match="weights need"):
        plan(load_shape("llama-3.1-70b"), Hardware(load_gpu("h100"), 1), PlanInputs(weight_dtype="bf16"))
    with pytest.raises(PlanError, match="FP8"):
        plan(load_shape("llama-3.1-8b"), Hardware(load_gpu("a100"), 1), PlanInputs(kv_dtype="fp8"))
    with pytest.raises(PlanError, match="free_gpu_memory_fraction"):
        PlanInputs(free_gpu_memory_fraction=1.0)  # kvCacheManager.cpp: must be < 1.0
    with pytest.raises(PlanError, match="power of two"):
        PlanInputs(tokens_per_block=48)
    with pytest.raises(HardwareError, match="multiple of tp"):
        Hardware(load_gpu("h100"), 6, 4)
    with pytest.raises(HardwareError, match="unknown GPU"):
        load_gpu("h300")


# --- incomplete configs -------------------------------------------------------------------------
def _config(name: str) -> dict:
    from importlib import resources

    return json.loads((resources.files("engines") / "capacity" / "data" / "models" / f"{name}.json").read_text())


@pytest.mark.parametrize(("name", "field"), [
    ("llama-3.1-8b", "num_hidden_layers"), ("llama-3.1-8b", "intermediate_size"), ("llama-3.1-8b", "vocab_size"),
    ("deepseek-v3", "qk_rope_head_dim"), ("deepseek-v3", "moe_intermediate_size"), ("deepseek-v3", "first_k_dense_replace"),
    ("mixtral-8x22b", "num_experts_per_tok"), ("qwen3-235b-a22b", "moe_intermediate_size"),
])
def test_incomplete_config_names_the_missing_field(name: str, field: str) -> None:
    config = _config(name)
    del config[field]
    with pytest.raises(ShapeError, match=repr(field)):
        shape_from_config(config, name=name)


def test_bad_values_are_refused() -> None:
    config = _config("llama-3.1-8b")
    with pytest.raises(ShapeError, match="must divide"):
        shape_from_config({**config, "num_key_value_heads": 5}, name="x")
    with pytest.raises(ShapeError, match="non-negative integer"):
        shape_from_config({**config, "hidden_size": "4096"}, name="x")
    with pytest.raises(ShapeError, match="no bundled model shape"):
        load_shape("llama-9")
