"""Sampled shadow pools: the fixed slice, plan mapping, and estimates against full replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retention.hashing import block_hashes
from retention.shadow import HashSample, MissRatioCurve, ShadowPool
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, request_hashes, simulate
from retention.trace import distinct_blocks, parse_trace
from retention.types import RetentionPlan, TokenRange
from retention.workloads import ChatSpec, chat_trace

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
B = 16


def test_sample_is_a_fixed_slice_of_the_hash_space() -> None:
    hashes = block_hashes(list(range(20_000 * B)), B)
    sample = HashSample(0.1)
    kept = sample.indices(hashes)
    assert kept == [i for i, h in enumerate(hashes) if sample.keeps(h)] == HashSample(0.1).indices(hashes)
    assert 0.08 < len(kept) / len(hashes) < 0.12
    other = HashSample(0.1, start=0.95)  # wraps around the top of the space
    assert set(kept) & set(other.indices(hashes)) == set(HashSample(0.05).indices(hashes))  # [0, 0.05) is in both
    assert 0.08 < len(other.indices(hashes)) / len(hashes) < 0.12
    assert HashSample(1.0).indices(hashes) == list(range(len(hashes)))
    assert HashSample(0.01).scale(439) == 4 and HashSample(0.01).scale(10) == 1 and HashSample(0.01).scale(0) == 0
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            HashSample(bad)
    with pytest.raises(ValueError):
        HashSample(0.1, start=1.0)


def test_kept_blocks_take_their_own_blocks_retention() -> None:
    shadow = ShadowPool(HashSample(1.0), primary_blocks=64)
    hashes = block_hashes(list(range(4 * B)), B)  # 4 full blocks
    plan = RetentionPlan((TokenRange(0, 2 * B, 80, None), TokenRange(2 * B, None, 20, 5_000)), 35, None)
    out = shadow.observe(hashes, plan, now=0.0, num_tokens=4 * B + 3, tokens_per_block=B, tenant="a")
    assert (out.kept, out.hits) == (4, 0)
    cached = sorted(shadow.pool.cached_blocks().values(), key=lambda b: b.release_seq, reverse=True)
    # Release is leaf first, so the root is the most recently released block.
    assert [(b.priority, b.duration_ms) for b in cached] == [(80, None), (80, None), (20, 5_000), (20, 5_000)]
    again = shadow.observe(hashes, plan, now=1.0, num_tokens=4 * B + 3, tokens_per_block=B, tenant="a")
    assert again.hits == 4
    assert shadow.tenants["a"].kept_blocks == 8 and shadow.counts.hit_blocks == 4


def test_a_request_too_big_for_the_shadow_counts_as_misses_and_changes_nothing() -> None:
    shadow = ShadowPool(HashSample(1.0), primary_blocks=3)
    small = block_hashes(list(range(2 * B)), B)
    shadow.observe(small, now=0.0, num_tokens=2 * B + 1, tokens_per_block=B)
    before = dict(shadow.pool.cached_blocks())
    big = block_hashes(list(range(1000, 1000 + 8 * B)), B)
    assert shadow.observe(big, now=1.0, num_tokens=8 * B + 1, tokens_per_block=B).hits == 0
    assert shadow.pool.cached_blocks() == before
    shadow.pool.check_invariants()


@pytest.mark.parametrize("policy,host", [("lru", 0), ("trtllm-default", 4)])
def test_unsampled_shadow_tracks_the_full_replay(policy: str, host: int) -> None:
    lines = chat_trace(ChatSpec(duration_s=300, block_size=B, sessions_per_s=1.0), seed=5)
    requests = parse_trace([json.dumps(x) for x in lines], block_size=B)
    config = SimConfig(tokens_per_block=B, trace_block_size=B)
    hashes = request_hashes(requests, config)
    gpu = round(0.05 * distinct_blocks(requests))
    full = simulate(requests, make_policy(policy), primary_blocks=gpu, secondary_blocks=host * gpu, config=config,
                    hashes=hashes)
    shadow = ShadowPool(HashSample(1.0), gpu, host * gpu if policy != "lru" else 0)
    for request, h in zip(requests, hashes, strict=True):
        shadow.observe(h, now=request.timestamp_ms / 1000.0, num_tokens=request.input_length, tokens_per_block=B)
    # Not exact: the shadow releases at once and never matches a prompt-length tail (see retention/shadow/pool.py).
    assert shadow.counts.hit_rate() == pytest.approx(full.hit_rate, abs=0.01)
    assert full.hit_rate > 0.2


@pytest.fixture(scope="module")
def mooncake():  # noqa: ANN201
    if not TRACE.exists():
        pytest.skip("shared Mooncake trace not present")
    with TRACE.open() as handle:
        requests = parse_trace(handle)
    return requests, request_hashes(requests, SimConfig())


def test_sampled_curve_estimates_full_replays_on_the_synthetic_trace(mooncake) -> None:  # noqa: ANN001
    """5 % samples (three disjoint slices) vs full LRU replays at 2 and 10 % GPU capacity.

    Measured (bench/retention/shadow.py, five slices): at 1 % slices are off by up to 3.7 points GPU
    only (4.3 with a 4× host), so the shadow target "1 % within 2 points" does not hold on a trace
    of 44 k distinct blocks; at 5 % GPU only every slice is within 1.6 points (3.0 with a
    host tier at 5 % GPU); at 10 % within 1.7 everywhere.
    """
    requests, hashes = mooncake
    distinct = distinct_blocks(requests)
    caps = [round(distinct * f) for f in (0.02, 0.10)]
    full = [simulate(requests, make_policy("lru"), primary_blocks=c, secondary_blocks=0, hashes=hashes).hit_rate
            for c in caps]
    estimates = []
    for start in (0.0, 0.4, 0.8):  # 0.4 is the worst of five slices at 1 %
        curve = MissRatioCurve(caps, rate=0.05)
        curve.sample = HashSample(0.05, start)
        curve.pools = [ShadowPool(curve.sample, c) for c in caps]
        for request, h in zip(requests, hashes, strict=True):
            curve.observe(h, now=request.timestamp_ms / 1000.0, num_tokens=request.input_length, tokens_per_block=512)
        estimates.append([point.hit_rate for point in curve.points()])
    for k, truth in enumerate(full):
        per_slice = [e[k] for e in estimates]
        assert all(abs(e - truth) < 0.02 for e in per_slice), (caps[k], truth, per_slice)
        assert abs(sum(per_slice) / len(per_slice) - truth) < 0.01


def test_jackknife_stderr_is_zero_when_groups_agree_and_grows_with_their_spread() -> None:
    from retention.shadow import ShadowCounts
    from retention.shadow.pool import JACKKNIFE_GROUPS

    counts = ShadowCounts(prompt_tokens=100, full_block_tokens=100)
    assert counts.hit_rate_stderr() is None
    counts.kept_by_group[3] = counts.kept_blocks = 10
    counts.hits_by_group[3] = counts.hit_blocks = 5
    assert counts.hit_rate() == 0.5 and counts.hit_rate_stderr() is None  # one group: no spread to measure
    counts.kept_by_group[7], counts.hits_by_group[7] = 10, 5
    counts.kept_blocks, counts.hit_blocks = 20, 10
    assert counts.hit_rate_stderr() == 0.0
    # Two groups at 0.2 and 0.8: leave-one-out values 0.8 and 0.2, jackknife variance (1/2) × 2 × 0.3² = 0.09.
    counts.hits_by_group[3], counts.hits_by_group[7] = 2, 8
    assert counts.hit_rate() == 0.5 and counts.hit_rate_stderr() == pytest.approx(0.3)
    # The token scale (full-block share of prompt tokens) scales the error like the estimate.
    counts.prompt_tokens = 200
    assert counts.hit_rate_stderr() == pytest.approx(0.15)
    assert len(counts.kept_by_group) == JACKKNIFE_GROUPS


def test_observe_splits_kept_blocks_and_hits_by_group() -> None:
    shadow = ShadowPool(HashSample(1.0), primary_blocks=64)
    hashes = block_hashes(list(range(12 * B)), B)
    for now in (0.0, 1.0):
        shadow.observe(hashes, now=now, num_tokens=12 * B + 1, tokens_per_block=B)
    c = shadow.counts
    assert (c.kept_blocks, c.hit_blocks) == (24, 12)
    assert sum(c.kept_by_group) == 24 and sum(c.hits_by_group) == 12
    for g, (k, h) in enumerate(zip(c.kept_by_group, c.hits_by_group, strict=True)):
        assert k == 2 * sum(1 for x in hashes if x % 16 == g) and h == k // 2


def test_one_percent_slices_state_their_own_error_on_the_synthetic_trace(mooncake) -> None:  # noqa: ANN001
    """At 1 % a slice is off by up to ~4 points (bench:shadow_accuracy); its interval says so.

    Every slice's estimate lies within 2.5 jackknife standard errors of the full replay, the
    stated error at 1 % is over a point (it does not pretend), and a 10 % slice's is far smaller.
    """
    requests, hashes = mooncake
    distinct = distinct_blocks(requests)
    caps = [round(distinct * f) for f in (0.02, 0.10)]
    full = [simulate(requests, make_policy("lru"), primary_blocks=c, secondary_blocks=0, hashes=hashes).hit_rate
            for c in caps]

    def run(rate: float, start: float) -> list:
        curve = MissRatioCurve(caps, rate=rate)
        curve.sample = HashSample(rate, start)
        curve.pools = [ShadowPool(curve.sample, c) for c in caps]
        for request, h in zip(requests, hashes, strict=True):
            curve.observe(h, now=request.timestamp_ms / 1000.0, num_tokens=request.input_length, tokens_per_block=512)
        return curve.points()

    for start in (0.0, 0.2, 0.4, 0.6, 0.8):
        for point, truth in zip(run(0.01, start), full, strict=True):
            assert abs(point.hit_rate - truth) <= 2.5 * point.stderr, (start, point, truth)
            assert point.stderr > 0.005
    wide, narrow = run(0.01, 0.4)[1], run(0.10, 0.4)[1]
    assert narrow.stderr < 0.5 * wide.stderr
