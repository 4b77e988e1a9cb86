"""``roll_back_host_tier``: every planned block stays below the offload threshold, for good."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention, roll_back_host_tier
from retention.pool import BlockPool, PoolConfig
from retention.types import RetentionPlan, RetentionPlanError, TokenRange

STANDARD = RetentionClassSpec(system=SegmentRetention(90, None), context=SegmentRetention(60, 600_000),
                              turn=SegmentRetention(40, 30_000), decode=SegmentRetention(20, 30_000))


def test_clamps_below_the_threshold_and_drops_durations_when_35_would_offload():
    plan = plan_retention(STANDARD, Segments(96, 128, 140), offload_min_priority=30)
    rolled = roll_back_host_tier(plan, 30)
    assert rolled.ranges == (TokenRange(0, 96, 29, None), TokenRange(96, 128, 29, None), TokenRange(128, None, 29, None))
    assert (rolled.decode_priority, rolled.decode_duration_ms) == (20, None)


def test_keeps_durations_when_the_threshold_is_above_35():
    plan = plan_retention(STANDARD, Segments(96, 128, 140), offload_min_priority=50)
    rolled = roll_back_host_tier(plan, 50)
    assert rolled.ranges == (TokenRange(0, 96, 49, None), TokenRange(96, 128, 49, 600_000),
                             TokenRange(128, None, 40, 30_000))
    assert (rolled.decode_priority, rolled.decode_duration_ms) == (20, 30_000)


def test_gaps_are_covered_and_threshold_zero_is_a_no_op():
    plan = RetentionPlan((TokenRange(32, 64, 80, None),), 90, None)
    rolled = roll_back_host_tier(plan, 30)
    assert rolled.ranges == (TokenRange(0, 32, 29, None), TokenRange(32, 64, 29, None), TokenRange(64, None, 29, None))
    assert roll_back_host_tier(RetentionPlan(), 30).ranges == (TokenRange(0, None, 29, None),)
    assert roll_back_host_tier(plan, 0) is plan
    with pytest.raises(RetentionPlanError):
        roll_back_host_tier(plan, 102)


spans = st.lists(st.tuples(st.integers(1, 64), st.integers(0, 100), st.one_of(st.none(), st.integers(0, 10**6))),
                 max_size=5)


@given(spans, st.integers(1, 101), st.integers(0, 100), st.booleans())
def test_no_planned_block_reaches_the_threshold(parts, threshold, decode, last_open):
    ranges, start = [], 0
    for i, (length, priority, duration) in enumerate(parts):
        end = None if last_open and i == len(parts) - 1 else start + length
        ranges.append(TokenRange(start, end, priority, duration))
        start += length + (i % 2)  # leave gaps sometimes
    plan = RetentionPlan(tuple(ranges), decode, None)
    rolled = roll_back_host_tier(plan, threshold)
    assert all(r.priority < threshold for r in rolled.ranges) and rolled.decode_priority < threshold
    assert rolled.ranges[0].start == 0 and rolled.ranges[-1].end is None  # every prompt token covered
    if threshold <= 35:
        assert all(r.duration_ms is None for r in rolled.ranges) and rolled.decode_duration_ms is None
    for original in plan.ranges:  # order kept: a higher priority never ends up lower
        for other in plan.ranges:
            if original.priority >= other.priority:
                a = next(r for r in rolled.ranges if r.start == original.start)
                b = next(r for r in rolled.ranges if r.start == other.start)
                assert a.priority >= b.priority


def test_the_real_pool_drops_instead_of_offloading():
    """Same traffic through the real pool: the plain plan offloads, the rolled-back one never does."""
    tokens_per_block = 4
    prompts = [list(range(1000 * i, 1000 * i + 4 * tokens_per_block + 1)) for i in range(6)]
    offloaded = {}
    for name, transform in (("plain", lambda p: p), ("rolled back", lambda p: roll_back_host_tier(p, 30))):
        pool = BlockPool(PoolConfig(primary_blocks=12, secondary_blocks=32, tokens_per_block=tokens_per_block,
                                    secondary_offload_min_priority=30))
        now = 0.0
        for round_ in range(3):
            for i, tokens in enumerate(prompts):
                plan = transform(plan_retention(STANDARD, Segments(8, 12, len(tokens)), offload_min_priority=30))
                rid = (round_, i)
                assert pool.allocate(rid, tokens, salt=None, tenant="t", plan=plan, now=now) is not None
                pool.release(rid, tokens, now=now, num_computed_tokens=len(tokens))
                now += 100.0  # far past every duration: an expired block falls back to 35 (>= 30)
        pool.check_invariants()
        offloaded[name] = pool.stats().offloaded_blocks
    assert offloaded["plain"] > 0 and offloaded["rolled back"] == 0
