"""Oracle reference policies: hand-computed tiny traces and an independent banded LRU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retention.simulation.oracle import (
    DROP,
    KEEP,
    future_use_counts,
    next_use_gaps,
    oracle_next_use,
    oracle_popularity,
    oracle_reuse,
    oracle_reuse_within,
    parse_oracle_name,
)
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import TraceRequest, distinct_blocks, parse_trace

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
TINY = SimConfig(tokens_per_block=4, trace_block_size=4)


def tiny(timestamps_and_ids: list[tuple[int, list[int]]], length: int = 5) -> list[TraceRequest]:
    return parse_trace(
        [json.dumps({"timestamp": ts, "input_length": length, "output_length": 1, "hash_ids": ids})
         for ts, ids in timestamps_and_ids],
        block_size=4,
    )


# A, B, C, A: 5-token prompts of 4-token blocks = one full (matchable) block + a partial one.
# Capacity 3: a miss needs 2 free blocks, so before C one of the cached A, B must go.
ABCA = [(0, [1, 90]), (1_000, [2, 91]), (2_000, [3, 92]), (100_000, [1, 93])]


def test_next_use_gaps_by_hand() -> None:
    assert next_use_gaps(tiny(ABCA), TINY) == [[100.0], [None], [None], [None]]
    # The last full block of an 8-token prompt is never matchable (the last token is not
    # matched), so only the first block's reuse counts.
    chained = tiny([(0, [1, 2]), (5_000, [1, 2]), (6_000, [1, 2])], length=8)
    assert next_use_gaps(chained, TINY) == [[5.0, None], [1.0, None], [None, None]]


def test_oracle_reuse_keeps_the_returning_prefix_that_lru_evicts() -> None:
    requests = tiny(ABCA)
    lru = simulate(requests, make_policy("lru"), primary_blocks=3, secondary_blocks=0, config=TINY)
    assert lru.hit_tokens == 0  # C evicts A (least recently used)
    gaps = next_use_gaps(requests, TINY)
    oracle = simulate(requests, oracle_reuse(gaps), primary_blocks=3, secondary_blocks=0, config=TINY)
    # A is KEEP, B is DROP: C evicts B, and the second A hits its one matchable block.
    assert (oracle.hit_tokens, oracle.prompt_tokens) == (4, 20)
    # Within 200 s A is still KEEP; within 10 s it is DROP like B, and LRU order evicts it.
    within_200 = simulate(requests, oracle_reuse_within(gaps, 200), primary_blocks=3, secondary_blocks=0, config=TINY)
    within_10 = simulate(requests, oracle_reuse_within(gaps, 10), primary_blocks=3, secondary_blocks=0, config=TINY)
    assert within_200.hit_tokens == 4 and within_10.hit_tokens == 0


def test_oracle_next_use_prefers_the_sooner_return() -> None:
    # B, A, C, B, D, B, A at capacity 3: B returns within seconds (twice), A after ~500 s.
    requests = tiny([(0, [1, 90]), (1_000, [2, 91]), (2_000, [3, 92]), (3_000, [1, 93]), (4_000, [4, 94]),
                     (5_000, [1, 95]), (500_000, [2, 96])])
    gaps = next_use_gaps(requests, TINY)
    assert [g[0] for g in gaps] == [3.0, 499.0, None, 2.0, None, None, None]
    run = lambda policy: simulate(requests, policy, primary_blocks=3, secondary_blocks=0, config=TINY).hit_tokens  # noqa: E731
    # One band: C evicts B (older), B misses and evicts C, D evicts A (older), B hits at 5 s, A misses.
    assert run(oracle_reuse(gaps)) == 4
    assert run(make_policy("lru")) == 4
    # Bands by next use: B (≤ 10 s → 90) outranks A (≤ 1000 s → 50): C evicts A, B hits at 3 s and 5 s.
    assert run(oracle_next_use(gaps)) == 8


def test_plan_bands_and_running_minimum() -> None:
    requests = tiny([(0, [1, 2, 3]), (1_000, [1, 2, 4])], length=12)
    gaps = next_use_gaps(requests, TINY)
    assert gaps[0] == [1.0, 1.0, None]
    policy = oracle_reuse(gaps)

    class _Pool:
        class config:  # noqa: N801 - mimics PoolConfig's attribute
            tokens_per_block = 4

    plan = policy.plan(requests[0], [], now=0.0, pool=_Pool())
    assert [(r.start, r.end, r.priority) for r in plan.ranges] == [(0, 8, KEEP), (8, None, DROP)]


def chain_keys(requests: list[TraceRequest]) -> list[list]:
    """Each request's chained block keys (equal key = equal prefix), independent of retention/."""
    keys_of = []
    for req in requests:
        keys, chain = [], ()
        for h in req.hash_ids:
            chain = hash((chain, h))
            keys.append(chain)
        keys_of.append(keys)
    return keys_of


def banded_lru_hit_tokens(requests: list[TraceRequest], capacity: int, block: int, horizon_s: float | None) -> int:
    """Two bands (reused-again [within horizon] or not), LRU inside: written independently of retention/.

    Same model as ``test_simulator.plain_lru_hit_tokens``; a block's band is decided by the
    last request that touched it, from the next request whose matchable prefix holds it.
    """
    keys_of = chain_keys(requests)
    next_time: list[dict] = [{} for _ in requests]
    upcoming: dict = {}
    for r in range(len(requests) - 1, -1, -1):
        req = requests[r]
        for key in keys_of[r][: req.input_length // block]:
            next_time[r][key] = upcoming.get(key)
        for key in keys_of[r][: (req.input_length - 1) // block]:
            upcoming[key] = req.timestamp_ms / 1000.0
    cache: dict = {}
    hit_tokens = 0
    for r, req in enumerate(requests):
        keys = keys_of[r]
        matchable = (req.input_length - 1) // block
        hits = 0
        while hits < matchable and keys[hits] in cache:
            hits += 1
        if len(keys) > capacity:
            continue
        hit_tokens += hits * block
        path = set(keys[:hits])
        need = len(keys) - hits - (capacity - len(cache))
        if need > 0:
            for _, key in sorted((stamp, key) for key, stamp in cache.items() if key not in path)[:need]:
                del cache[key]
        now = req.timestamp_ms / 1000.0
        for i in range(req.input_length // block):
            nxt = next_time[r][keys[i]]
            keep = nxt is not None and (horizon_s is None or nxt - now <= horizon_s)
            cache[keys[i]] = (int(keep), r, -i)
    return hit_tokens


@pytest.mark.parametrize("horizon", [None, 30.0])
def test_oracle_equals_independent_banded_lru_on_mooncake(horizon: float | None) -> None:
    if not TRACE.exists():
        pytest.skip("shared Mooncake trace not present")
    with TRACE.open() as handle:
        requests = parse_trace(handle)
    capacity = round(distinct_blocks(requests) * 0.01)
    gaps = next_use_gaps(requests)
    policy = oracle_reuse(gaps) if horizon is None else oracle_reuse_within(gaps, horizon)
    result = simulate(requests, policy, primary_blocks=capacity, secondary_blocks=0)
    assert result.hit_tokens == banded_lru_hit_tokens(requests, capacity, 512, horizon)
    lru = simulate(requests, make_policy("lru"), primary_blocks=capacity, secondary_blocks=0)
    assert result.hit_tokens > lru.hit_tokens


def test_priorities() -> None:
    gaps: list[list[float | None]] = [[]]
    assert oracle_reuse(gaps).priority(None) == DROP and oracle_reuse(gaps).priority(1e9) == KEEP
    assert oracle_reuse_within(gaps, 30).priority(30.0) == KEEP and oracle_reuse_within(gaps, 30).priority(30.5) == DROP
    ladder = oracle_next_use(gaps)
    assert ladder.priority(5) > ladder.priority(50) > ladder.priority(5000) > ladder.priority(None) == DROP


def test_future_use_counts_by_hand() -> None:
    # Block 1 is matchable in requests at 0, 5, 6 and 400 s; the 8-token prompts' second block never is.
    requests = tiny([(0, [1, 2]), (5_000, [1, 2]), (6_000, [1, 3]), (400_000, [1, 2])], length=8)
    assert future_use_counts(requests, 10, TINY) == [[2, 0], [1, 0], [0, 0], [0, 0]]
    assert future_use_counts(requests, 400, TINY) == [[3, 0], [2, 0], [1, 0], [0, 0]]
    # Equal timestamps: only *later* requests count, never the request itself.
    same = tiny([(0, [1, 90]), (0, [1, 91]), (0, [1, 92])])
    assert future_use_counts(same, 1, TINY) == [[2], [1], [0]]


def test_oracle_popularity_keeps_the_busier_prefix() -> None:
    # A, B, C, then A three times and B once (A at 3, 4, 6 s; B at 5 s). Capacity 3: C's miss
    # needs one of the cached A, B to go.
    requests = tiny([(0, [1, 90]), (1_000, [2, 91]), (2_000, [3, 92]), (3_000, [1, 93]), (4_000, [1, 94]),
                     (5_000, [2, 95]), (6_000, [1, 96])])
    policy = oracle_popularity(future_use_counts(requests, 100, TINY), 100)
    assert [row[0] for row in policy.known] == [3, 1, 0, 2, 1, 0, 0]
    assert policy.priority(0) == DROP < policy.priority(1) < policy.priority(3) <= 100
    run = lambda p: simulate(requests, p, primary_blocks=3, secondary_blocks=0, config=TINY).hit_tokens  # noqa: E731
    # Popularity: C evicts B (one use ahead), not A (three): A hits at 3, 4 and 6 s, B misses.
    assert run(policy) == 12
    # LRU evicts A (older): A misses at 3 s (evicting B), hits at 4 and 6 s, B misses at 5 s.
    assert run(make_policy("lru")) == 8
    # A 1.5 s window sees no use ahead of A or B when C arrives (both DROP, LRU order): as LRU.
    assert run(oracle_popularity(future_use_counts(requests, 1.5, TINY), 1.5)) == 8


def test_oracle_names_parse() -> None:
    assert parse_oracle_name("oracle-popularity-300s") == 300.0
    assert parse_oracle_name("oracle-reuse-within-30s") == 30.0
    assert parse_oracle_name("oracle-reuse") is None
    for bad in ("oracle-popularity-s", "oracle-popularity-0s", "oracle-popularity-infs", "oracle-bogus"):
        with pytest.raises(ValueError, match="known: oracle-reuse"):
            parse_oracle_name(bad)


def test_oracle_popularity_equals_independent_count_on_mooncake_prefix() -> None:
    """Counts against a brute-force scan over the first 400 requests of the real trace."""
    if not TRACE.exists():
        pytest.skip("shared Mooncake trace not present")
    with TRACE.open() as handle:
        requests = parse_trace(handle)[:400]
    counts = future_use_counts(requests, 60)
    keys_of = chain_keys(requests)
    for r, req in enumerate(requests):
        now = req.timestamp_ms
        for i in range(req.input_length // 512):
            expected = sum(
                1 for later in range(r + 1, len(requests))
                if requests[later].timestamp_ms - now <= 60_000
                and keys_of[r][i] in keys_of[later][: (requests[later].input_length - 1) // 512]
            )
            assert counts[r][i] == expected, (r, i)
