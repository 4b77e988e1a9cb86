"""The computed retention view: host vs dropped, with TensorRT-LLM's inclusive threshold."""

from __future__ import annotations

import pytest

from tenants.snapshots import PoolSnapshot, ReplicaSnapshot, RetentionClassSnapshot, SegmentRetention
from tenants.views import retention_view, tier_on_eviction


@pytest.mark.parametrize(
    ("priority", "threshold", "host_blocks", "tier"),
    [
        (35, 35, 10, "host"),  # inclusive: at the threshold goes to host
        (34, 35, 10, "dropped"),
        (100, 0, 10, "host"),
        (0, 0, 10, "host"),
        (100, 35, 0, "dropped"),  # no host tier: everything evicted is dropped
    ],
)
def test_tier_on_eviction(priority: int, threshold: int, host_blocks: int, tier: str) -> None:
    assert tier_on_eviction(priority, offload_min_priority=threshold, secondary_blocks=host_blocks) == tier


def test_view_covers_every_segment_in_order() -> None:
    pool = PoolSnapshot(1, "p", "m", "kvgate_llm", "", 32, 100, 50, 50, (ReplicaSnapshot(1, "r0", "h:1", "active", 1),))
    cls = RetentionClassSnapshot(
        1,
        "c",
        SegmentRetention(90, None),
        SegmentRetention(50, 600_000),
        SegmentRetention(49, 30_000),
        SegmentRetention(10, None),
    )
    view = retention_view(pool, cls)
    assert [(v.segment, v.priority, v.duration_ms, v.tier_on_eviction) for v in view] == [
        ("system", 90, None, "host"),
        ("context", 50, 600_000, "host"),
        ("turn", 49, 30_000, "dropped"),
        ("decode", 10, None, "dropped"),
    ]


def test_a_class_honouring_hints_shows_where_hinted_blocks_go() -> None:
    from retention.policy.hint_plan import HintPolicy

    pool = PoolSnapshot(1, "p", "m", "kvgate_llm", "", 32, 100, 50, 50, (ReplicaSnapshot(1, "r0", "h:1", "active", 1),))
    seg = SegmentRetention(20, None)
    off = RetentionClassSnapshot(1, "c", seg, seg, seg, seg)
    assert [v.segment for v in retention_view(pool, off)] == ["system", "context", "turn", "decode"]
    on = RetentionClassSnapshot(1, "c", seg, seg, seg, seg,
                                hints=HintPolicy(enabled=True, max_ttl_ms=3_600_000, max_priority=60))
    hints = retention_view(pool, on)[-1]
    assert (hints.segment, hints.priority, hints.duration_ms, hints.tier_on_eviction) == ("hints", 60, 3_600_000, "host")
    low = RetentionClassSnapshot(1, "c", seg, seg, seg, seg, hints=HintPolicy(enabled=True, max_priority=49))
    assert retention_view(pool, low)[-1].tier_on_eviction == "dropped"
