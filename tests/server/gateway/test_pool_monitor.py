"""Quota state from pool stats: demotion above quota, hysteresis, rebuild after a restart."""

from __future__ import annotations

from engines.contract import PoolStatsReport, TierStats
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
from server.gateway.engines import EngineDirectory
from server.gateway.pool_monitor import PoolMonitor, TenantQuota

POOL = PoolSnapshot(1, "p", "m", "kvgate_llm", "reference-smollm2", 16, 100, 400, 35, (ReplicaSnapshot(1, "r0", "127.0.0.1:1", "active", 1),))
TENANTS = [TenantQuota(1, "premium", 0.5), TenantQuota(2, "flood", 0.2)]


def stats(**held: int) -> PoolStatsReport:
    tenants = {str(t.tenant_id): [held.get(t.slug, 0), 0] for t in TENANTS}
    used = sum(held.values())
    return PoolStatsReport(16, TierStats(100, 100 - used, used), TierStats(400, 400, 0), tenants=tenants)


def monitor() -> PoolMonitor:
    return PoolMonitor(EngineDirectory(lambda pool: None), lambda: [])


def test_over_quota_is_demoted_with_hysteresis() -> None:
    m = monitor()
    m.apply(POOL, stats(flood=20), TENANTS)  # exactly at its 20-block quota: not over
    assert not m.quota_state("p", 2).over_quota
    m.apply(POOL, stats(flood=21), TENANTS)
    assert m.quota_state("p", 2).over_quota
    m.apply(POOL, stats(flood=19), TENANTS)  # under quota but above the 90 % low watermark: stays demoted
    assert m.quota_state("p", 2).over_quota
    m.apply(POOL, stats(flood=17), TENANTS)  # below 18 = 0.9 x 20: demotion stops
    assert not m.quota_state("p", 2).over_quota
    m.apply(POOL, stats(flood=19), TENANTS)  # and does not restart until the quota is crossed again
    assert not m.quota_state("p", 2).over_quota
    assert not m.quota_state("p", 1).over_quota


def test_state_is_rebuilt_from_stats_after_a_restart() -> None:
    before = monitor()
    before.apply(POOL, stats(flood=30, premium=10), TENANTS)
    after = monitor()  # a new gateway process: no memory, same engine stats
    after.apply(POOL, stats(flood=30, premium=10), TENANTS)
    assert after.quota_state("p", 2) == before.quota_state("p", 2)
    assert after.quota_state("p", 2).over_quota and not after.quota_state("p", 1).over_quota


def test_unknown_pool_or_tenant_is_not_demoted() -> None:
    m = monitor()
    assert not m.quota_state("nope", 1).over_quota
    m.apply(POOL, stats(), TENANTS)
    assert not m.quota_state("p", 99).over_quota


def test_snapshots_feed_the_quota_metrics() -> None:
    m = monitor()
    m.apply(POOL, stats(flood=30, premium=10), TENANTS)
    (snap,) = m.snapshots()
    assert snap.tenant_slugs == {"1": "premium", "2": "flood"}
    assert snap.tenant_quota_blocks == {"premium": 50.0, "flood": 20.0}
    assert snap.demoted == {"premium": False, "flood": True}
