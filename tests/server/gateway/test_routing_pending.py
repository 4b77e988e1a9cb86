"""A request's prompt, stored by the engine at the end of its prefill, reaches the router only
with the replica's next KV events: until a report known to cover the request's end arrives, the
router keeps the prompt pending there. Fake engine clients and a real pool route (no stack)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engines.kv_events import KvEventsReport
from engines.pool_stats import PoolStatsReport, TierStats
from retention.hashing import block_hashes
from retention.routing import Decision, RouteRequest
from server.gateway.replicas.routing import Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

TPB = 16


class FakeEngine:
    async def stats(self, timeout=5.0, *, events_since=None):
        return PoolStatsReport(TPB, TierStats(1000, 1000, 0), TierStats(0, 0, 0))

    async def close(self) -> None:
        pass


def _pool() -> PoolSnapshot:
    return PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", TPB, 1000, 0, 30,
                        (ReplicaSnapshot(0, "r0", "127.0.0.1:9000", "active", 1),
                         ReplicaSnapshot(1, "r1", "127.0.0.1:9001", "active", 1)))


def test_an_ended_requests_prompt_stays_pending_until_a_poll_sent_after_its_end_answers() -> None:
    """The engine stores a prompt at the end of its prefill, but the router learns it only from
    the replica's next KV events. Between a request's end and that report, a follow-up turn must
    still find the prompt on its replica; a poll sent before the end (answering after it) is no
    such report."""

    async def run() -> None:
        clock = SimpleNamespace(now=100.0)
        routing = Routing(RoutingConfig(), clock=lambda: clock.now)
        route = routing.route(_pool())
        travel: dict[int, float] = {}  # replica -> when its poll's answer arrives

        class Reporting(FakeEngine):
            def __init__(self, rid: int) -> None:
                self.rid = rid

            async def stats(self, timeout=5.0, *, events_since=None):
                if self.rid in travel:
                    clock.now = travel.pop(self.rid)
                return PoolStatsReport(TPB, TierStats(1000, 1000, 0), TierStats(0, 0, 0),
                                       kv_events=KvEventsReport("e", 0, snapshot={} if not events_since else None))

        for replica in route.replicas.values():
            await replica.client.close()
            replica.client = Reporting(replica.id)
            await route.poll(replica)  # precise from the first report
        router = route.router
        hashes = tuple(block_hashes(tuple(range(500, 500 + 8 * TPB)), TPB, salt="s"))
        request = RouteRequest("a", hashes, 8 * TPB + 1, 4)
        router.on_dispatch(request, Decision(0, "kv-aware"), now=clock.now)
        clock.now = 101.0
        router.on_complete("a", now=clock.now)
        assert router.match(0, hashes, now=clock.now).pending_blocks == 8
        clock.now, travel[0] = 100.5, 101.5  # sent before the end, answering after it
        await route.poll(route.replicas[0])
        assert clock.now == 101.5 and router.match(0, hashes, now=clock.now).pending_blocks == 8
        clock.now = 102.0
        await route.poll(route.replicas[0])
        assert router.match(0, hashes, now=clock.now).pending_blocks == 0

    asyncio.run(run())


def test_a_replica_without_kv_events_keeps_no_pending_blocks_of_requests_that_ended_before_its_first_poll() -> None:
    """No report will ever settle them: a replica found to send no events (approximate mode)
    releases what ended there, even what ended before the poll that found it out."""

    async def run() -> None:
        clock = SimpleNamespace(now=100.0)
        routing = Routing(RoutingConfig(), clock=lambda: clock.now)
        route = routing.route(_pool())
        replica = route.replicas[0]
        await replica.client.close()
        replica.client = FakeEngine()  # no kv_events in its stats: it cannot report events
        router = route.router
        hashes = tuple(block_hashes(tuple(range(500, 500 + 8 * TPB)), TPB, salt="s"))
        router.on_dispatch(RouteRequest("a", hashes, 8 * TPB + 1, 4), Decision(0, "kv-aware"), now=clock.now)
        clock.now = 101.0
        router.on_complete("a", now=clock.now)  # before any poll
        clock.now = 102.0
        await route.poll(replica)
        match = router.match(0, hashes, now=clock.now)
        assert match.pending_blocks == 0, match

    asyncio.run(run())
