from __future__ import annotations

import pytest

from retention.policy.quota import QuotaError, QuotaTracker


def test_demotes_above_high_and_restores_only_below_low() -> None:
    tracker = QuotaTracker(100, {"a": 0.5}, hysteresis=0.2)  # high 50, low 40
    assert tracker.update({"a": (50, 0)}) == [] and not tracker.state("a").over_quota
    (change,) = tracker.update({"a": (51, 3)})
    assert change.over_quota and tracker.state("a").over_quota
    for blocks in (49, 45, 41):  # between the watermarks: still demoted, no flapping
        assert tracker.update({"a": (blocks, 0)}) == []
        assert tracker.state("a").over_quota
    (change,) = tracker.update({"a": (40, 0)})
    assert not change.over_quota and not tracker.state("a").over_quota
    assert tracker.update({"a": (45, 0)}) == [] and not tracker.state("a").over_quota


def test_secondary_blocks_and_unknown_tenants_do_not_count() -> None:
    tracker = QuotaTracker(10, {"a": 0.5})
    tracker.update({"a": (1, 500), "b": (10, 0)})
    assert not tracker.state("a").over_quota
    assert not tracker.state("b").over_quota and not tracker.state(None).over_quota
    assert tracker.update({}) == []  # a tenant with no blocks is simply at 0


def test_rebuild_from_counts_after_restart() -> None:
    counts = {"over": (60, 0), "between": (45, 0), "under": (10, 0)}
    live = QuotaTracker(100, {"over": 0.5, "between": 0.5, "under": 0.5}, hysteresis=0.2)
    live.update({"over": (60, 0), "between": (60, 0), "under": (10, 0)})
    live.update(counts)  # 'between' stays demoted in the live tracker (hysteresis)
    rebuilt = QuotaTracker.rebuild(100, live.quotas, counts, hysteresis=0.2)
    assert rebuilt.state("over").over_quota and not rebuilt.state("under").over_quota
    assert not rebuilt.state("between").over_quota  # conservative restart, documented
    rebuilt.update({"between": (51, 0)})
    assert rebuilt.state("between").over_quota
    assert rebuilt.usage(counts)["over"] == pytest.approx(60 / 50)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"capacity_blocks": 0, "quotas": {}}, "capacity_blocks"),
    ({"capacity_blocks": 10, "quotas": {"a": 0}}, "quota of 'a'"),
    ({"capacity_blocks": 10, "quotas": {"a": 1.5}}, "quota of 'a'"),
    ({"capacity_blocks": 10, "quotas": {}, "hysteresis": 1.0}, "hysteresis"),
])
def test_invalid_configuration_is_named(kwargs, message) -> None:
    with pytest.raises(QuotaError, match=message):
        QuotaTracker(**kwargs)


def test_demotion_stops_once_back_under_quota_in_the_pool() -> None:
    """End to end with the pool and planner: demoted while over, undemoted once under."""
    from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention
    from retention.pool import BlockPool, PoolConfig

    pool = BlockPool(PoolConfig(primary_blocks=10, tokens_per_block=4))
    tracker = QuotaTracker(10, {"t": 0.5}, hysteresis=0.2)  # high 5, low 4
    cls = RetentionClassSpec(*(SegmentRetention(60) for _ in range(4)))
    held = []
    for i in range(3):  # three requests of 2 blocks each, held: 6 blocks > 5
        tokens = list(range(100 * i, 100 * i + 8))
        tracker.update(pool.tenant_blocks())
        plan = plan_retention(cls, Segments(0, 0, 8), offload_min_priority=30, quota=tracker.state("t"))
        assert pool.allocate(i, tokens, salt=None, tenant="t", plan=plan, now=0) is not None
        held.append((i, tokens))
    tracker.update(pool.tenant_blocks())
    assert tracker.state("t").over_quota
    plan = plan_retention(cls, Segments(0, 0, 8), offload_min_priority=30, quota=tracker.state("t"))
    assert plan.demoted and {r.priority for r in plan.ranges} == {0}
    for rid, tokens in held[:2]:  # cancel two requests: their blocks become empty
        pool.release(rid, tokens, now=1, num_computed_tokens=0)
    tracker.update(pool.tenant_blocks())
    assert pool.tenant_blocks()["t"] == (2, 0) and not tracker.state("t").over_quota
    plan = plan_retention(cls, Segments(0, 0, 8), offload_min_priority=30, quota=tracker.state("t"))
    assert not plan.demoted and {r.priority for r in plan.ranges} == {60}
