"""The hit-density ceiling: hand-computed hulls and knapsack, and the claim it makes about
LRU (an age-based policy) on generated chat traffic, where think times are i.i.d."""

from __future__ import annotations

import json

import pytest

from retention.simulation.belady import ChainRequest, chain_request
from retention.simulation.hit_density import IdlePeriods, age_ceiling, best_hits, hull, idle_periods, shared_keys
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, request_hashes, simulate
from retention.trace import distinct_blocks, parse_trace
from retention.workloads import ChatSpec, chat_trace


def one_block(key: int) -> ChainRequest:
    # 1 token per block: a 2-token prompt has one full, matchable block and a partial one.
    return ChainRequest(keys=(key,), total_blocks=2, matchable_blocks=1, prompt_tokens=2)


def test_shared_keys_are_branching_prefixes_and_their_ancestors():
    a = chain_request([1, 2, 3, 10], 17, 4)
    b = chain_request([1, 2, 3, 20, 21], 21, 4)
    c = chain_request([1, 2, 3, 10, 11], 21, 4)  # 10 is continued by a's end and by 11: not branching
    d = chain_request([7, 8], 9, 4)  # a chain of its own
    assert shared_keys([a, b, c, d]) == {1, 2, 3}


def test_idle_periods_split_by_class_and_end_at_the_trace_end():
    reqs = [one_block(1), one_block(1), one_block(2), one_block(2)]
    shared, private = idle_periods(reqs, [0.0, 10.0, 11.0, 12.0], shared=set())
    assert shared == IdlePeriods([], [])
    assert sorted(private.gaps) == [1.0, 10.0] and sorted(private.never) == [0.0, 2.0]
    with pytest.raises(ValueError, match="timestamp order"):
        idle_periods(reqs, [0.0, 10.0, 9.0, 12.0], shared=set())
    with pytest.raises(ValueError, match="one timestamp"):
        idle_periods(reqs, [0.0], shared=set())


def test_hull_and_knapsack_by_hand():
    # Gaps 1 and 10, open periods 0 and 2. Hold D = 1: 1 hit, occupancy 1 + 1 + (0 + 1) = 3.
    # Hold D = 10: 2 hits, occupancy 1 + 10 + (0 + 2) = 13. Slopes 1/3 then 1/10: concave.
    vertices = hull(IdlePeriods([1.0, 10.0], [0.0, 2.0]))
    assert vertices == [(0.0, 0.0), (3.0, 1.0), (13.0, 2.0)]
    assert best_hits([vertices], 3.0) == [1.0]
    assert best_hits([vertices], 8.0) == [pytest.approx(1.5)]
    assert best_hits([vertices], 100.0) == [2.0]
    # A vertex under the chord is dropped: gaps 1, 2, 100 with nothing open give (3, 1), (5, 2),
    # (103, 3); (3, 1) lies under the chord from (0, 0) to (5, 2).
    assert hull(IdlePeriods([1.0, 2.0, 100.0], [])) == [(0.0, 0.0), (5.0, 2.0), (103.0, 3.0)]
    # Two classes: the steeper one is filled first.
    steep, flat = [(0.0, 0.0), (1.0, 1.0)], [(0.0, 0.0), (10.0, 1.0)]
    assert best_hits([flat, steep], 6.0) == [pytest.approx(0.5), 1.0]


def test_ceiling_by_hand_and_at_infinite_capacity():
    reqs = [one_block(1), one_block(1), one_block(2), one_block(2)]
    times = [0.0, 10.0, 11.0, 12.0]
    # 1 block over 12 s: 12 block-seconds buy 1 + 9/10 hits (the hull above).
    assert age_ceiling(reqs, times, 1, 1).private_hit_tokens == pytest.approx(1.9)
    roomy = age_ceiling(reqs, times, 100, 1)
    assert roomy.private_hit_tokens == roomy.reusable_tokens == 2
    assert roomy.hit_rate == pytest.approx(2 / 8)
    with pytest.raises(ValueError):
        age_ceiling(reqs, times, 0, 1)


@pytest.fixture(scope="module")
def chat():
    requests = parse_trace([json.dumps(x) for x in chat_trace(ChatSpec(duration_s=600.0), seed=3)])
    hashes = request_hashes(requests, SimConfig())
    chains = [chain_request(h, r.input_length, 512) for h, r in zip(hashes, requests, strict=True)]
    return requests, hashes, chains, [r.timestamp_ms / 1000 for r in requests]


@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.05, 0.2])
def test_lru_never_beats_the_ceiling_on_chat(chat, fraction):
    """LRU holds every idle block until its turnover: an age-based policy, so under the ceiling."""
    requests, hashes, chains, times = chat
    gpu = max(1, round(distinct_blocks(requests) * fraction))
    lru = simulate(requests, make_policy("lru"), primary_blocks=gpu, secondary_blocks=0, hashes=hashes)
    ceiling = age_ceiling(chains, times, gpu, 512)
    assert lru.hit_rate <= ceiling.hit_rate
    assert ceiling.shared_hit_tokens + ceiling.private_hit_tokens <= ceiling.reusable_tokens
    # the four system prompts are the shared class
    assert ceiling.shared_hit_rate > 0.1
