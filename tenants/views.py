"""The computed retention view operators read per tenant.

For each segment (system, context, turn, decode): its priority and duration, and where
its blocks go when evicted from GPU memory. TensorRT-LLM offloads a GPU victim to the
host tier iff the pool has host blocks and ``priority >= secondary_offload_min_priority``
(inclusive; ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``, ``KvCacheConfig``
in ``cpp/include/tensorrt_llm/executor/executor.h``); otherwise it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenants.snapshots import PoolSnapshot, RetentionClassSnapshot

SEGMENTS = ("system", "context", "turn", "decode")


@dataclass(frozen=True, slots=True)
class SegmentView:
    segment: str
    priority: int
    duration_ms: int | None
    tier_on_eviction: str  # "host" | "dropped"


def tier_on_eviction(priority: int, *, offload_min_priority: int, secondary_blocks: int) -> str:
    return "host" if secondary_blocks > 0 and priority >= offload_min_priority else "dropped"


def retention_view(pool: PoolSnapshot, cls: RetentionClassSnapshot) -> list[SegmentView]:
    """One row per segment, plus a ``hints`` row when the class honours client cache hints:
    the priority hinted tokens get (at most), the longest duration a hint may ask for, and
    where hinted blocks go when evicted (``retention/policy/hint_plan.py``)."""
    out = []
    for segment in SEGMENTS:
        seg = getattr(cls, segment)
        out.append(
            SegmentView(
                segment=segment,
                priority=seg.priority,
                duration_ms=seg.duration_ms,
                tier_on_eviction=tier_on_eviction(
                    seg.priority,
                    offload_min_priority=pool.secondary_offload_min_priority,
                    secondary_blocks=pool.secondary_blocks,
                ),
            )
        )
    if cls.hints.enabled:
        out.append(SegmentView(
            segment="hints", priority=cls.hints.max_priority, duration_ms=cls.hints.max_ttl_ms,
            tier_on_eviction=tier_on_eviction(cls.hints.max_priority,
                                              offload_min_priority=pool.secondary_offload_min_priority,
                                              secondary_blocks=pool.secondary_blocks),
        ))
    return out
