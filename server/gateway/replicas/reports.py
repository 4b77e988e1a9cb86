"""A replica's stats as the router and the pool gauges read them: its KV events as pool events,
and the pool's report summed over its replicas."""

from __future__ import annotations

from collections.abc import Iterable

from engines.kv_events import MOVED, REMOVED, STORED, KvEventsReport
from engines.pool_stats import PoolStatsReport, TierStats
from retention.pool.events import CreatedEvent, KvEvent, RemovedEvent, StoredBlock, StoredEvent, UpdatedEvent
from retention.types import Tier

__all__ = ["report_as_pool_events", "sum_reports"]


def report_as_pool_events(report: KvEventsReport) -> list[KvEvent]:
    """A replica's event report as ``retention.pool.events`` for the router's precise index.

    A snapshot becomes a *created* event (the index clears) followed by one *stored* event
    per cached block; records keep their sequence numbers as event ids so that the index's
    gap counter stays meaningful.
    """
    out: list[KvEvent] = []
    if report.snapshot is not None:
        base = report.next_seq - 1
        out.append(CreatedEvent(base - 1, (0, 0)))
        out.append(StoredEvent(base, None, tuple(StoredBlock(h, (), Tier(t), 0) for h, t in report.snapshot.items())))
    for record in report.events:
        if record.kind == STORED:
            out.append(StoredEvent(record.seq, None, tuple(StoredBlock(h, (), Tier(record.tier), 0) for h in record.hashes)))
        elif record.kind == REMOVED:
            out.append(RemovedEvent(record.seq, record.hashes))
        elif record.kind == MOVED:
            for h in record.hashes:
                # The old level is not carried; the index only reads the new one.
                out.append(UpdatedEvent(record.seq, h, (Tier(1 - record.tier), Tier(record.tier))))
    return out


def sum_reports(reports: Iterable[PoolStatsReport]) -> PoolStatsReport | None:
    """One pool-level report from its replicas': capacities, counters and tenant blocks add up.

    Quotas stay per pool: a tenant's share is measured against the pool's summed GPU
    blocks, with its blocks summed over replicas.
    """
    reports = list(reports)
    if not reports:
        return None
    first = reports[0]
    total = PoolStatsReport(first.tokens_per_block, TierStats(0, 0, 0), TierStats(0, 0, 0),
                            secondary_offload_min_priority=first.secondary_offload_min_priority)
    counters = ("reused_blocks", "missed_blocks", "alloc_total_blocks", "alloc_new_blocks", "offloaded_blocks",
                "onboarded_blocks", "evicted_blocks")
    for report in reports:
        for tier_name in ("primary", "secondary"):
            mine, theirs = getattr(total, tier_name), getattr(report, tier_name)
            mine.max_blocks += theirs.max_blocks
            mine.free_blocks += theirs.free_blocks
            mine.used_blocks += theirs.used_blocks
        for name in counters:
            setattr(total, name, getattr(total, name) + getattr(report, name))
        for tenant, counts in report.tenants.items():
            held = total.tenants.setdefault(tenant, [0, 0])
            held[0] += counts[0]
            held[1] += counts[1]
    lookups = total.reused_blocks + total.missed_blocks
    total.cache_hit_rate = total.reused_blocks / lookups if lookups else 0.0
    return total
