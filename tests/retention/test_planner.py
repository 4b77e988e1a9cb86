from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retention.policy.planner import (
    QuotaState,
    RetentionClassSpec,
    SegmentRetention,
    Segments,
    offloads,
    plan_retention,
)
from retention.types import RetentionPlanError, TokenRange

PREMIUM = RetentionClassSpec(
    system=SegmentRetention(90, None),
    context=SegmentRetention(60, 600_000),
    turn=SegmentRetention(40, 30_000),
    decode=SegmentRetention(40, 30_000),
)


def test_three_segments_give_three_ranges_last_open() -> None:
    plan = plan_retention(PREMIUM, Segments(100, 300, 350), offload_min_priority=30)
    assert plan.ranges == (
        TokenRange(0, 100, 90, None),
        TokenRange(100, 300, 60, 600_000),
        TokenRange(300, None, 40, 30_000),
    )
    assert (plan.decode_priority, plan.decode_duration_ms, plan.demoted) == (40, 30_000, False)
    assert plan.retention_at(299) == (60, 600_000) and plan.retention_at(10_000) == (40, 30_000)


def test_empty_segments_produce_no_range() -> None:
    plan = plan_retention(PREMIUM, Segments(0, 0, 50), offload_min_priority=30)
    assert plan.ranges == (TokenRange(0, None, 40, 30_000),)
    plan = plan_retention(PREMIUM, Segments(50, 50, 50), offload_min_priority=30)
    assert plan.ranges == (TokenRange(0, None, 90, None),)


def test_equal_neighbours_merge() -> None:
    flat = SegmentRetention(50, None)
    cls = RetentionClassSpec(flat, flat, SegmentRetention(10), flat)
    plan = plan_retention(cls, Segments(10, 20, 30), offload_min_priority=30)
    assert plan.ranges == (TokenRange(0, 20, 50, None), TokenRange(20, None, 10, None))


def test_over_quota_demotes_everything_to_zero() -> None:
    plan = plan_retention(PREMIUM, Segments(100, 300, 350), offload_min_priority=30, quota=QuotaState(over_quota=True))
    assert plan.demoted
    assert plan.ranges == (TokenRange(0, None, 0, None),)
    assert (plan.decode_priority, plan.decode_duration_ms) == (0, None)


def test_validation_names_the_problem() -> None:
    with pytest.raises(RetentionPlanError, match="system_end <= context_end <= total"):
        Segments(10, 5, 20)
    with pytest.raises(RetentionPlanError, match="total must be > 0"):
        Segments(0, 0, 0)
    with pytest.raises(RetentionPlanError, match="priority must be within"):
        SegmentRetention(101)
    with pytest.raises(RetentionPlanError, match="duration_ms must be >= 0"):
        SegmentRetention(10, -1)
    with pytest.raises(RetentionPlanError, match="offload_min_priority"):
        plan_retention(PREMIUM, Segments(1, 2, 3), offload_min_priority=-3)
    with pytest.raises(RetentionPlanError) as info:
        Segments(-1, 0, 1)
    assert info.value.field == "system_end"


def test_offload_threshold_is_inclusive() -> None:
    assert offloads(SegmentRetention(30), 30) and not offloads(SegmentRetention(29), 30)


def test_demote_matches_over_quota_planning() -> None:
    from retention.policy.planner import demote

    normal = plan_retention(PREMIUM, Segments(100, 300, 350), offload_min_priority=30)
    over = plan_retention(PREMIUM, Segments(100, 300, 350), offload_min_priority=30, quota=QuotaState(over_quota=True))
    assert demote(normal) == over and demote(normal).demoted


retentions = st.builds(SegmentRetention, st.sampled_from([0, 10, 35, 60, 90]), st.sampled_from([None, 1000]))


@given(
    cls=st.builds(RetentionClassSpec, retentions, retentions, retentions, retentions),
    cuts=st.lists(st.integers(0, 500), min_size=3, max_size=3).map(sorted),
    over=st.booleans(),
)
def test_plans_cover_the_prompt_without_gaps_and_merge_neighbours(cls, cuts, over) -> None:
    system_end, context_end, total = cuts
    if total == 0:
        total = 1
    plan = plan_retention(cls, Segments(system_end, context_end, total), offload_min_priority=35,
                          quota=QuotaState(over))
    assert plan.ranges[0].start == 0 and plan.ranges[-1].end is None
    for a, b in zip(plan.ranges, plan.ranges[1:]):
        assert a.end == b.start and (a.priority, a.duration_ms) != (b.priority, b.duration_ms)
    for t in {0, system_end, context_end, total - 1} - {total}:
        segment = cls.system if t < system_end else cls.context if t < context_end else cls.turn
        expected = (0, None) if over else (segment.priority, segment.duration_ms)
        assert plan.retention_at(t) == expected
