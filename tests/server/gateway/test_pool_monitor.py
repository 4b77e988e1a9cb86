"""Quota state from pool stats: demotion above quota, hysteresis, rebuild after a restart."""

from __future__ import annotations

from engines.pool_stats import PoolStatsReport, TierStats
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
from server.gateway.replicas.engines import EngineDirectory
from server.gateway.replicas.pool_monitor import PoolMonitor, TenantQuota

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


# --- registry vs engine capacity ---------------------------------------------------------------
OVERSIZED = PoolSnapshot(1, "p", "m", "kvgate_llm", "reference-smollm2", 16, 2048, 4096, 35, (ReplicaSnapshot(1, "r0", "127.0.0.1:1", "active", 1),))


def test_capacity_mismatch_is_pure_and_names_each_difference() -> None:
    from server.gateway.observe.capacity_check import capacity_mismatch

    check = capacity_mismatch(OVERSIZED, {"r0": stats()})
    assert check.mismatch and check.effective_primary == 100
    assert (check.reported_primary, check.reported_secondary, check.reported_tokens_per_block) == (100, 400, 16)
    assert "primary_blocks registered 2048, engine reports 100" in check.message()
    assert "secondary_blocks registered 4096, engine reports 400" in check.message()
    assert "tokens_per_block" not in check.message()
    assert not capacity_mismatch(POOL, {"r0": stats()}).mismatch
    # an engine that reports no blocks yet: compute with the registry's figure
    empty = PoolStatsReport(16, TierStats(0, 0, 0), TierStats(0, 0, 0))
    assert capacity_mismatch(OVERSIZED, {"r0": empty}).effective_primary == 2048


def test_quota_uses_the_engines_blocks_and_the_mismatch_is_logged_once(caplog) -> None:
    m = monitor()
    with caplog.at_level("WARNING", logger="kvgate.gateway"):
        m.apply(OVERSIZED, stats(flood=21), TENANTS)  # 21 > 0.2 × 100 engine blocks (but far under 0.2 × 2048)
        m.apply(OVERSIZED, stats(flood=21), TENANTS)
    assert m.quota_state("p", 2).over_quota
    warnings = [r for r in caplog.records if "registry and engine disagree" in r.getMessage()]
    assert len(warnings) == 1
    assert m.capacity("p").mismatch
    (snap,) = m.snapshots()
    assert snap.tenant_quota_blocks["flood"] == 20.0 and snap.capacity.registered_primary == 2048


def test_capacity_gauges() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.metrics import GatewayMetrics

    m = monitor()
    m.apply(OVERSIZED, stats(), TENANTS)
    registry = CollectorRegistry()
    GatewayMetrics(registry, m.snapshots)
    text = generate_latest(registry).decode()
    assert 'kvgate_pool_capacity_mismatch{pool="p"} 1.0' in text
    assert 'kvgate_pool_registered_blocks{pool="p",tier="primary"} 2048.0' in text
    assert 'kvgate_pool_blocks{pool="p",state="max",tier="primary"} 100.0' in text
    m.apply(POOL, stats(), TENANTS)  # the operator fixed the registry
    assert 'kvgate_pool_capacity_mismatch{pool="p"} 0.0' in generate_latest(registry).decode()


# --- two replicas: the registration is per replica ----------------------------------------------
TWO = PoolSnapshot(1, "p", "m", "kvgate_llm", "reference-smollm2", 16, 100, 400, 35,
                   (ReplicaSnapshot(1, "r0", "127.0.0.1:1", "active", 1), ReplicaSnapshot(2, "r1", "127.0.0.1:2", "active", 1)))


def test_two_replicas_each_matching_the_registration_are_no_mismatch() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.metrics import GatewayMetrics
    from server.gateway.replicas.reports import sum_reports

    each = {"r0": stats(flood=10), "r1": stats(flood=15)}  # 100 GPU blocks each, as registered
    m = monitor()
    m.apply(TWO, sum_reports(each.values()), TENANTS, each)
    check = m.capacity("p")
    assert not check.mismatch and (check.reported_primary, check.reported_secondary) == (100, 400)
    assert check.effective_primary == 200  # quotas are per pool: the replicas' blocks add up
    assert m.quota_state("p", 2).over_quota is False  # 25 held <= 0.2 x 200
    registry = CollectorRegistry()
    GatewayMetrics(registry, m.snapshots)
    assert 'kvgate_pool_capacity_mismatch{pool="p"} 0.0' in generate_latest(registry).decode()

    small = PoolStatsReport(16, TierStats(64, 64, 0), TierStats(400, 400, 0))
    check = capacity_mismatch_of({"r0": stats(), "r1": small})
    assert check.mismatch and check.reported_primary == 64
    assert "replica 'r1' primary_blocks registered 100, engine reports 64" in check.message()
    assert "'r0'" not in check.message() and check.effective_primary == 164


def capacity_mismatch_of(reports):  # noqa: ANN001, ANN201
    from server.gateway.observe.capacity_check import capacity_mismatch

    return capacity_mismatch(TWO, reports)


def test_one_pools_failing_poll_does_not_stop_the_refresh_of_the_pools_after_it(caplog) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from server.gateway.replicas.routing import Routing

    a = PoolSnapshot(1, "a", "m", "kvgate_llm", "spec", 16, 100, 400, 35,
                     (ReplicaSnapshot(10, "a0", "127.0.0.1:1", "active", 1),))
    b = PoolSnapshot(2, "b", "m", "kvgate_llm", "spec", 16, 100, 400, 35,
                     (ReplicaSnapshot(20, "b0", "127.0.0.1:2", "active", 1),))

    class Polls(Routing):
        def __init__(self) -> None:
            super().__init__()
            self.polled: list[str] = []

        async def poll(self, pool):  # type: ignore[no-untyped-def]
            self.polled.append(pool.name)
            if pool.name == "a":
                raise TypeError("PoolStatsReport.__init__() got an unexpected keyword argument 'x'")
            return stats(premium=10)

        def route(self, pool):  # type: ignore[no-untyped-def]
            class _Route:
                @staticmethod
                def replica_reports():  # type: ignore[no-untyped-def]
                    return {"b0": stats(premium=10)}

                last_reports = replica_reports
            return _Route()

    routing = Polls()
    m = PoolMonitor(EngineDirectory(lambda pool: None), lambda: [(a, TENANTS), (b, TENANTS)], routing=routing)

    async def twice() -> None:
        await m.refresh()
        await m.refresh()

    asyncio.run(twice())
    assert routing.polled == ["a", "b", "a", "b"]
    assert m.stats("b") is not None and m.stats("a") is None
    assert "pool a" in caplog.text


def test_a_pool_the_registry_no_longer_lists_is_forgotten_with_its_state() -> None:
    """Deleted or renamed: the directory stops polling the old name (so the SLO guards, which follow
    it, drop that pool's guard) and its stats, quotas and metric series go; a failed listing forgets
    nothing (the registry being away is not a deletion)."""
    import asyncio

    from server.gateway.replicas.routing import Routing

    a = PoolSnapshot(1, "a", "m", "kvgate_llm", "spec", 16, 100, 400, 35,
                     (ReplicaSnapshot(10, "a0", "127.0.0.1:1", "active", 1),))
    renamed = PoolSnapshot(1, "a2", "m", "kvgate_llm", "spec", 16, 100, 400, 35, a.replicas)

    class Polls(Routing):
        async def poll(self, pool):  # type: ignore[no-untyped-def]
            return stats(premium=10)

        def route(self, pool):  # type: ignore[no-untyped-def]
            class _Route:
                @staticmethod
                def replica_reports():  # type: ignore[no-untyped-def]
                    return {"a0": stats(premium=10)}

                last_reports = replica_reports
            return _Route()

    listings: list[object] = [[(a, TENANTS)], RuntimeError("registry away"), [(renamed, TENANTS)], []]

    def listing():  # type: ignore[no-untyped-def]
        item = listings.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    directory = EngineDirectory(lambda pool: None)
    m = PoolMonitor(directory, listing, routing=Polls())
    asyncio.run(m.refresh())
    assert set(directory.pools) == {"a"} and m.stats("a") is not None
    asyncio.run(m.refresh())  # the registry is away: the last state stays
    assert set(directory.pools) == {"a"} and m.stats("a") is not None
    asyncio.run(m.refresh())  # renamed
    assert set(directory.pools) == {"a2"} and m.stats("a") is None and m.stats("a2") is not None
    assert [s.pool for s in m.snapshots()] == ["a2"]
    asyncio.run(m.refresh())  # deleted
    assert directory.pools == {} and m.snapshots() == [] and m.capacity("a2") is None


def test_a_forgotten_pools_route_goes_with_its_replica_series() -> None:
    """The pool's route goes too: no replica series (a down replica's KvgateReplicaDown would fire
    for a pool that no longer exists) and no peer-sync heartbeats for it; its clients are closed."""
    import asyncio

    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.metrics import ReplicaCollector
    from server.gateway.replicas.routing import Routing

    # Nothing listens on port 1: the stats poll fails and the replica's breaker opens (a down engine).
    old = PoolSnapshot(1, "old", "m", "kvgate_llm", "spec", 16, 100, 400, 35,
                       (ReplicaSnapshot(10, "r0", "127.0.0.1:1", "active", 1),))
    listings = [[(old, TENANTS)], []]
    routing = Routing()
    monitor = PoolMonitor(EngineDirectory(lambda pool: None), lambda: listings.pop(0), routing=routing)
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(routing.rows))

    async def go() -> None:
        await monitor.refresh()
        assert 'pool="old"' in generate_latest(registry).decode()
        replica = routing.pools["old"].replicas[10]
        await monitor.refresh()  # deleted from the registry
        assert routing.pools == {} and replica.state == "removed"

    asyncio.run(go())
    assert 'pool="old"' not in generate_latest(registry).decode()
    assert monitor.snapshots() == []


def test_a_scrape_survives_pools_the_monitor_adds_while_it_runs() -> None:
    """/metrics runs in a worker thread while the event loop adds pools to the monitor's live
    ``engine_up``: the collector reads a copy, so the scrape does not fail mid-iteration."""
    import threading

    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.metrics import PoolStatsCollector

    engine_up = {f"p{i}": True for i in range(50_000)}
    registry = CollectorRegistry()
    registry.register(PoolStatsCollector(lambda: [], lambda: engine_up))
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            engine_up[f"new{i % 64}"] = True
            engine_up.pop(f"new{(i + 32) % 64}", None)
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            generate_latest(registry)
    finally:
        stop.set()
        thread.join()
