"""Simulator: exact agreement with an independent LRU prefix cache, hold modes, classes, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retention.simulation.sim_policies import ClassMapping, ClassMappingError, make_policy
from retention.simulation.simulator import SimConfig, run_simulation, simulate
from retention.trace import TraceError, TraceRequest, distinct_blocks, parse_trace, request_tokens

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
BS = 512


def plain_lru_hit_tokens(requests: list[TraceRequest], capacity: int, block: int) -> tuple[int, int]:
    """An LRU prefix cache over hash-id chains, written independently of retention/.

    Model (the TensorRT-LLM conventions the pool follows): the last prompt token is never
    matched; a request needs all its blocks (partial tail included) resident while it runs;
    afterwards its full blocks are cached, stamped so that within a request deeper blocks
    are older (they are released first); eviction takes the oldest stamp outside the
    request's matched prefix; content-free slots are used before evicting.
    """
    cache: dict[object, tuple[int, int]] = {}
    hit_tokens = prompt_tokens = 0
    for r, req in enumerate(requests):
        prompt_tokens += req.input_length
        keys, chain = [], ()
        for h in req.hash_ids:
            chain = hash((chain, h))
            keys.append(chain)
        total = len(req.hash_ids)
        full = req.input_length // block
        matchable = (req.input_length - 1) // block
        hits = 0
        while hits < matchable and keys[hits] in cache:
            hits += 1
        if total > capacity:
            continue
        hit_tokens += hits * block
        path = set(keys[:hits])
        need = total - hits - (capacity - len(cache))
        if need > 0:
            victims = sorted((stamp, key) for key, stamp in cache.items() if key not in path)[:need]
            for _, key in victims:
                del cache[key]
        for i in range(full):
            cache[keys[i]] = (r, -i)
    return hit_tokens, prompt_tokens


@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    if not TRACE.exists():
        pytest.skip("shared Mooncake trace not present")
    with TRACE.open() as handle:
        return parse_trace(handle)


@pytest.mark.parametrize("fraction", [0.01, 0.04])
def test_lru_hold_none_equals_independent_lru_exactly(mooncake: list[TraceRequest], fraction: float) -> None:
    capacity = round(distinct_blocks(mooncake) * fraction)
    result = simulate(mooncake, make_policy("lru"), primary_blocks=capacity, secondary_blocks=0)
    hit_tokens, prompt_tokens = plain_lru_hit_tokens(mooncake, capacity, BS)
    assert result.prompt_tokens == prompt_tokens
    assert result.hit_tokens == hit_tokens
    assert result.host_hit_tokens == 0 and result.hit_tokens > 0


def small_trace(lines: list[dict]) -> list[TraceRequest]:
    return parse_trace([json.dumps(line) for line in lines], block_size=4)


def test_hold_tokens_makes_requests_wait_for_capacity() -> None:
    lines = [{"timestamp": i, "input_length": 16, "output_length": 8, "hash_ids": [10 * i + k for k in range(4)]}
             for i in range(6)]
    requests = small_trace(lines)
    cfg = SimConfig(tokens_per_block=4, trace_block_size=4, hold="tokens", prefill_tokens_per_s=100, decode_tokens_per_s=10)
    result = simulate(requests, make_policy("lru"), primary_blocks=7, secondary_blocks=0, config=cfg)
    # Each request needs 4 prompt + 2 reserve blocks: only one fits at a time.
    assert result.requests == 6 and result.rejected == 0
    assert result.delayed_requests == 5 and result.total_wait_s > 0
    none = simulate(requests, make_policy("lru"), primary_blocks=7, secondary_blocks=0,
                    config=SimConfig(tokens_per_block=4, trace_block_size=4))
    assert none.delayed_requests == 0


def test_oversized_requests_are_rejected_not_crashing() -> None:
    requests = small_trace([{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": list(range(10))}])
    cfg = SimConfig(tokens_per_block=4, trace_block_size=4)
    for hold in ("none", "tokens"):
        result = simulate(requests, make_policy("lru"), primary_blocks=5, secondary_blocks=0,
                          config=SimConfig(tokens_per_block=4, trace_block_size=4, hold=hold))
        assert (result.rejected, result.recomputed_prefill_tokens) == (1, 40)
    assert cfg.hold == "none"


def test_host_tier_turns_gpu_evictions_into_host_hits() -> None:
    lines = []
    for i in range(30):  # a shared 3-block prefix revisited after unique floods
        ids = [0, 1, 2, 100 + i] if i % 3 == 0 else [1000 + 10 * i + k for k in range(4)]
        lines.append({"timestamp": i, "input_length": 16, "output_length": 1, "hash_ids": ids})
    requests = small_trace(lines)
    cfg = SimConfig(tokens_per_block=4, trace_block_size=4)
    reports = run_simulation(
        requests, [lambda: make_policy("lru"), lambda: make_policy("trtllm-default")], [5],
        host_blocks=lambda gpu: 4 * gpu, config=cfg,
    )
    (report,) = reports
    lru, trt = report.results["lru"], report.results["trtllm-default"]
    assert lru.hit_tokens == 0  # floods evict the prefix from 5 GPU blocks
    assert trt.host_hit_tokens > 0 and trt.onboarded_blocks > 0 and trt.offloaded_blocks > 0
    assert report.belady_gpu.hit_tokens >= lru.hit_tokens
    assert report.belady_total is not None and report.belady_total.hit_tokens >= trt.hit_tokens


CLASSES = {
    "offload_min_priority": 35,
    "default": "bulk",
    "classes": {
        "premium": {"system": {"priority": 90}, "context": {"priority": 90}, "turn": {"priority": 90},
                    "decode": {"priority": 35}},
        "bulk": {"system": {"priority": 0}, "context": {"priority": 0}, "turn": {"priority": 0},
                 "decode": {"priority": 0}},
    },
    "tenants": {"gold": "premium"},
}


def test_class_policy_protects_the_premium_tenant() -> None:
    lines = []
    for i in range(40):
        if i % 4 == 0:
            lines.append({"timestamp": i, "input_length": 13, "output_length": 1, "hash_ids": [0, 1, 2, 50 + i],
                          "tenant": "gold"})
        else:
            lines.append({"timestamp": i, "input_length": 16, "output_length": 1,
                          "hash_ids": [1000 + 10 * i + k for k in range(4)], "tenant": "noisy"})
    requests = small_trace(lines)
    cfg = SimConfig(tokens_per_block=4, trace_block_size=4)
    mapping = ClassMapping.from_dict(CLASSES)
    lru = simulate(requests, make_policy("lru"), primary_blocks=8, secondary_blocks=0, config=cfg)
    cls = simulate(requests, make_policy("class", mapping=mapping, block_size=4), primary_blocks=8,
                   secondary_blocks=0, config=cfg)
    assert cls.tenants["gold"].hit_rate > lru.tenants["gold"].hit_rate
    assert cls.tenants["gold"].hit_rate > 0.5


def test_class_mapping_errors_name_the_key() -> None:
    bad = json.loads(json.dumps(CLASSES))
    bad["tenants"]["x"] = "missing"
    with pytest.raises(ClassMappingError, match="tenants.x names unknown class 'missing'"):
        ClassMapping.from_dict(bad)
    bad = json.loads(json.dumps(CLASSES))
    bad["classes"]["bulk"]["turn"] = {"priority": 500}
    with pytest.raises(ClassMappingError, match=r"classes.bulk.turn: priority must be within"):
        ClassMapping.from_dict(bad)
    with pytest.raises(ClassMappingError, match="unknown policy"):
        make_policy("nope")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "line 1: not valid JSON"),
        ('{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1]}', "expected 3"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], "tenant": 5}', "tenant"),
    ],
)
def test_trace_errors_name_line_and_field(line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace([line], block_size=4)


def test_synthetic_tokens_equal_iff_hash_ids_equal() -> None:
    a, b, c = small_trace([
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 1, "input_length": 6, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 2, "input_length": 8, "output_length": 1, "hash_ids": [7, 9]},
    ])
    ta, tb, tc = (request_tokens(r, 4) for r in (a, b, c))
    assert list(ta[:6]) == list(tb) and list(ta[:4]) == list(tc[:4]) and list(ta[4:]) != list(tc[4:])


def test_request_tokens_builds_only_the_prompts_positions() -> None:
    """The same tokens as every block's full width cut to the prompt, without allocating that width
    (a trace naming a block size of 2e9 must not take the machine's memory)."""
    import numpy as np

    from retention import trace as trace_module

    for block_size, ids, length in ((4, [3, 9, 3], 11), (16, [1, 2], 32), (512, [7], 1)):
        request = TraceRequest(0, 0.0, length, 1, tuple(ids))
        grid = ((np.asarray(ids, np.int64)[:, None] * trace_module._MULT + np.arange(block_size)[None, :])
                & trace_module._MASK)
        assert request_tokens(request, block_size).tolist() == grid.reshape(-1)[:length].astype(np.int32).tolist()
    huge = request_tokens(TraceRequest(0, 0.0, 10, 1, (5,)), 2_000_000_000)
    assert huge.shape == (10,)
