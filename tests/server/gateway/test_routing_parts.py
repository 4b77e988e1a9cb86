"""The gateway routing's pure parts: breaker timing, summed pool stats, events into the index."""

from __future__ import annotations

from engines.pool_stats import PoolStatsReport, TierStats
from engines.kv_events import GPU, HOST, MOVED, REMOVED, STORED, KvEventLog
from retention.routing import KvAwareRouter
from server.gateway.replicas.breaker import Breaker
from server.gateway.replicas.reports import report_as_pool_events, sum_reports


def test_breaker_opens_on_failure_backs_off_and_closes_on_success() -> None:
    b = Breaker()
    assert b.closed and b.probe_due(0.0)
    assert b.fail(10.0, 0.5, 4.0) is True  # opened
    assert not b.closed and not b.probe_due(10.4) and b.probe_due(10.5)
    assert b.fail(10.5, 0.5, 4.0) is False  # already open: the wait doubles
    assert not b.probe_due(11.4) and b.probe_due(11.5)
    for _ in range(5):
        b.fail(20.0, 0.5, 4.0)
    assert b.retry_at == 24.0  # capped
    assert b.probe_ok() is True and b.closed and b.failures == 0


def test_pool_stats_are_summed_over_replicas() -> None:
    a = PoolStatsReport(16, TierStats(100, 60, 40), TierStats(0, 0, 0), reused_blocks=3, missed_blocks=1,
                        tenants={"1": [30, 0], "2": [10, 0]})
    b = PoolStatsReport(16, TierStats(100, 80, 20), TierStats(50, 50, 0), reused_blocks=1, missed_blocks=3,
                        tenants={"1": [20, 0]})
    total = sum_reports([a, b])
    assert total.primary == TierStats(200, 140, 60) and total.secondary == TierStats(50, 50, 0)
    assert total.tenants == {"1": [50, 0], "2": [10, 0]}
    assert total.cache_hit_rate == 0.5
    assert sum_reports([]) is None


def test_event_reports_rebuild_the_routers_precise_index() -> None:
    truth: dict[int, int] = {}
    log = KvEventLog(lambda: dict(truth), capacity=4)
    router = KvAwareRouter(tokens_per_block=16)
    cursor = 0

    def step(kind, hashes, tier=GPU):
        nonlocal cursor
        log.append(kind, hashes, tier)
        for h in hashes:
            if kind == REMOVED:
                truth.pop(h)
            else:
                truth[h] = tier
        report = log.report(cursor)
        router.apply_events(7, report_as_pool_events(report), now=0.0)
        cursor = report.next_seq

    step(STORED, (1, 2, 3))
    assert router.match(7, (1, 2, 3, 4), now=0.0).gpu_blocks == 3
    step(MOVED, (3,), HOST)
    m = router.match(7, (1, 2, 3), now=0.0)
    assert (m.gpu_blocks, m.host_blocks) == (2, 1)
    step(REMOVED, (2,))
    assert router.match(7, (1, 2, 3), now=0.0).blocks == 1  # a chain stops at the first miss
    for h in range(10, 16):  # more records than the ring keeps: the next poll is a snapshot
        log.append(STORED, (h,))
        truth[h] = GPU
    report = log.report(cursor)
    assert report.snapshot is not None
    router.apply_events(7, report_as_pool_events(report), now=0.0)
    assert router.match(7, (1,), now=0.0).blocks == 1 and router.match(7, (2,), now=0.0).blocks == 0
    assert router.match(7, (15,), now=0.0).blocks == 1


def test_a_replica_without_events_gets_an_approximate_index_fed_by_dispatches() -> None:
    import asyncio

    from engines.kv_events import KvEventsReport
    from retention.routing import ApproximateIndex, RouteRequest
    from server.gateway.replicas.routing import PoolRoute, RoutingConfig
    from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

    async def scenario() -> None:
        pool = PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 64, 0, 35,
                            (ReplicaSnapshot(5, "r0", "127.0.0.1:1", "active", 1),
                             ReplicaSnapshot(6, "r1", "127.0.0.1:2", "active", 1)))
        route = PoolRoute(pool, RoutingConfig(), clock=lambda: 0.0)
        try:
            route._feed(route.replicas[5], KvEventsReport.unsupported())  # orchestrator mode
            assert route.replicas[5].events is False
            assert isinstance(route.router.index(5), ApproximateIndex)
            request = RouteRequest("q", (11, 12, 13), 64, 4)
            assert route.router.match(5, (11, 12, 13), now=0.0).blocks == 0
            only_r0 = [c for c in route.candidates(set()) if c.replica == 5]
            decision = route.router.route(request, only_r0, now=0.0)
            route.router.on_dispatch(request, decision, now=0.0)
            route.router.on_complete("q", now=0.0)
            # what was sent there is now expected there
            assert route.router.match(5, (11, 12, 13), now=0.0).blocks == 3
            # a draining replica is no candidate
            route.sync(PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 64, 0, 35,
                                    (ReplicaSnapshot(5, "r0", "127.0.0.1:1", "draining", 1),
                                     ReplicaSnapshot(6, "r1", "127.0.0.1:2", "active", 1))))
            assert [c.replica for c in route.candidates(set())] == [6]
        finally:
            for replica in route.replicas.values():
                await replica.client.close()

    asyncio.run(scenario())


def test_the_first_response_deadline_covers_the_whole_answer_when_the_engine_does_not_stream() -> None:
    from tests.engines.reference.helpers import make_request
    from server.gateway.replicas.routing import RoutingConfig

    config = RoutingConfig(first_token_timeout_s=2.0, answer_timeout_per_token_s=0.25)
    assert config.first_response_wait(make_request([1, 2, 3], 40, streaming=True)) == 2.0
    assert config.first_response_wait(make_request([1, 2, 3], 40, streaming=False)) == 2.0 + 40 * 0.25
    assert RoutingConfig(first_token_timeout_s=0).first_response_wait(make_request([1], 4, streaming=True)) is None
