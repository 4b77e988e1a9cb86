from __future__ import annotations

import json

import pytest

from retention.policy.adaptive import AdaptiveConfig, ReuseStats, adaptive_plan, priority_for, reservoir_add
from retention.hashing import block_hashes
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import simulate
from retention.trace import parse_trace
from retention.workloads import NoisyNeighbourSpec, noisy_neighbour_trace

B = 4


def test_statistics_are_bounded_per_tenant() -> None:
    stats = ReuseStats(AdaptiveConfig(max_entries=50))
    for i in range(200):
        stats.observe("t", block_hashes(list(range(i * 100, i * 100 + 12)), B), float(i))
    assert len(stats.tenant("t").entries) == 50 and stats.num_entries() == 50
    assert len(stats.tenant("t").gaps) <= stats.config.reservoir


def test_the_cached_horizon_is_always_the_quantile_of_the_gaps_as_they_are() -> None:
    # A small reservoir fills, then takes new gaps ever more rarely: the cached horizon must
    # follow every change (a stale one would keep blocks for an old horizon).
    stats = ReuseStats(AdaptiveConfig(reservoir=8, min_horizon_ms=0))
    shared = list(range(8))
    assert stats.horizon_ms("t") == stats.config.max_horizon_ms  # no gap measured yet
    now, changes = 0.0, 0
    for i in range(120):
        now += 0.5 + (i * 7 % 11)  # varying gaps, so the quantile moves as the reservoir does
        before = list(stats.tenant("t").gaps)
        stats.observe("t", block_hashes(shared + [1_000 + i] * 4, B), now, num_blocks=3)
        changes += stats.tenant("t").gaps != before
        cached = stats.horizon_ms("t")
        ordered = sorted(stats.tenant("t").gaps)
        expected = int(ordered[int(0.5 * len(ordered))] * 1000.0) if ordered else stats.config.max_horizon_ms
        assert cached == expected
    assert 8 < changes < 2 * 119  # the reservoir filled, then changed only some of the time


def test_reservoir_add_says_whether_the_value_went_in() -> None:
    reservoir: list[float] = []
    assert all(reservoir_add(reservoir, float(i), count=i + 1, salt=0, size=2) for i in range(2))
    outcomes = [reservoir_add(reservoir, 9.0, count=count, salt=12345, size=2) for count in range(3, 40)]
    assert True in outcomes and False in outcomes and len(reservoir) == 2


def test_forgetting_keeps_chain_roots_longest() -> None:
    stats = ReuseStats(AdaptiveConfig(max_entries=3))
    chain = block_hashes(list(range(16)), B)  # 4 blocks, one over the bound
    stats.observe("t", chain, 0.0)
    assert stats.uses("t", chain) == [1, 1, 1, 0]  # the deepest block was forgotten first


def test_one_shot_flood_sinks_and_reused_prefixes_stay_kept() -> None:
    stats = ReuseStats()
    shared = list(range(8))  # a 2-block system prompt reused by every 'chat' request
    for i in range(60):
        now = float(i)
        flood = block_hashes([10_000 + 50 * i + k for k in range(24)], B)
        stats.observe("flood", flood, now, num_blocks=6)
        chat = block_hashes(shared + [5_000 + i] * 4, B)
        stats.observe("chat", chat, now, num_blocks=3)
    flood_plan = adaptive_plan(stats, "flood", block_hashes(list(range(90_000, 90_024)), B), num_tokens=24,
                               tokens_per_block=B, offload_min_priority=30)
    chat_plan = adaptive_plan(stats, "chat", block_hashes(shared + [1, 2, 3, 4], B), num_tokens=14,
                              tokens_per_block=B, offload_min_priority=30)
    assert {r.priority for r in flood_plan.ranges} <= {0, 30}
    # The shared prefix (used 60 times) sits in the top kept band for the tenant's horizon
    # (its median reuse gap, 1 s here); the new tail blocks are first uses (T = 30).
    priorities = [chat_plan.retention_at(i * B)[0] for i in range(4)]
    assert priorities[:2] == [46, 46] and priorities[2:] == [30, 30]
    assert chat_plan.ranges[0].duration_ms == stats.horizon_ms("chat") == 1_000
    assert all(r.duration_ms is None for r in chat_plan.ranges if r.priority <= 35)
    untimed = ReuseStats(AdaptiveConfig(use_durations=False))
    for i in range(3):
        untimed.observe("chat", block_hashes(shared + [5_000 + i] * 4, B), float(i), num_blocks=3)
    plan = adaptive_plan(untimed, "chat", block_hashes(shared + [1, 2, 3, 4], B), num_tokens=14,
                         tokens_per_block=B, offload_min_priority=30)
    assert plan.ranges[0].priority > 35 and all(r.duration_ms is None for r in plan.ranges)


def test_priorities_never_increase_along_a_chain() -> None:
    stats = ReuseStats()
    deep = block_hashes(list(range(16)), B)  # 4 blocks
    stats.observe("t", deep[:2], 0.0)  # the first two blocks seen once before ...
    stats.observe("t", deep[:1], 1.0)  # ... the first one twice
    plan = adaptive_plan(stats, "t", deep, num_tokens=16, tokens_per_block=B, offload_min_priority=30)
    assert [plan.retention_at(i * B)[0] for i in range(4)] == [46, 36, 30, 30]


def test_priority_bands_relative_to_threshold() -> None:
    cfg = AdaptiveConfig()
    assert priority_for(0.001, 5, 30, cfg) == 0  # measured one-shot traffic: dropped, whatever its uses
    assert priority_for(0.9, 0, 30, cfg) == 30  # a first use: lowest offloadable band
    assert priority_for(0.03, 1, 30, cfg) == 36 and priority_for(0.03, 1, 50, cfg) == 51
    assert priority_for(0.5, 2, 30, cfg) == 46 == priority_for(0.5, 9, 30, cfg)
    three = AdaptiveConfig(use_bands=3, band_step=5)
    assert [priority_for(0.5, u, 30, three) for u in (1, 2, 3, 4)] == [36, 41, 46, 46]
    assert priority_for(0.5, 2, 95, cfg) == 100  # capped at the maximum priority
    with pytest.raises(ValueError):
        AdaptiveConfig(use_bands=0)


def test_noisy_neighbour_premium_survives_with_adaptive_and_classes() -> None:
    spec = NoisyNeighbourSpec(duration_s=240, block_size=B)
    mixed = parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=3)], block_size=B)
    solo = parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=3, include_noisy=False)], block_size=B)
    assert {r.tenant for r in mixed} == {"premium", "noisy"} and {r.tenant for r in solo} == {"premium"}
    from retention.simulation.simulator import SimConfig

    cfg = SimConfig(tokens_per_block=B, trace_block_size=B)
    alone = simulate(solo, make_policy("lru"), primary_blocks=96, secondary_blocks=0, config=cfg).tenants["premium"]
    lru = simulate(mixed, make_policy("lru"), primary_blocks=96, secondary_blocks=0, config=cfg).tenants["premium"]
    policy = make_policy("adaptive")
    policy.uses_host = False
    adaptive = simulate(mixed, policy, primary_blocks=96, secondary_blocks=0, config=cfg).tenants["premium"]
    assert lru.hit_rate < 0.6 * alone.hit_rate
    assert adaptive.hit_rate > lru.hit_rate + 0.2


@pytest.mark.parametrize("seed", [0, 1])
def test_generator_is_deterministic_and_well_formed(seed: int) -> None:
    spec = NoisyNeighbourSpec(duration_s=60, block_size=B)
    lines = noisy_neighbour_trace(spec, seed=seed)
    assert lines == noisy_neighbour_trace(spec, seed=seed)
    requests = parse_trace([json.dumps(x) for x in lines], block_size=B)
    premium = [r for r in requests if r.tenant == "premium"]
    noisy = [r for r in requests if r.tenant == "noisy"]
    assert len(noisy) > 5 * len(premium) > 0
    assert all(r.hash_ids[: spec.system_blocks] == tuple(range(spec.system_blocks)) for r in premium)
    assert all(r.system_tokens == spec.system_blocks * B <= r.context_tokens < r.input_length for r in premium)
