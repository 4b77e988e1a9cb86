"""The gateway's KV-event mirror stays true through the awkward cases of its poll loop: a report
that does not continue the replica's cursor, a poll answered after the breaker opened, a stats
answer this gateway cannot read. And a breaker that opens drops the replica's index, not the
load of the requests still running there (fake engine clients, an injected clock)."""

from __future__ import annotations

import asyncio
import secrets

from engines.contract import EngineRequest, KvMetrics, SamplingParams
from engines.kv_events import GPU, STORED, KvEventLog, KvEventRecord, KvEventsReport
from engines.pool_stats import PoolStatsReport, TierStats
from retention.types import RetentionPlan
from server.gateway.replicas.engine_client import EngineChunk, EngineUnavailable
from server.gateway.replicas.routing import PoolRoute, Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Stats from a real :class:`KvEventLog`; ``gate`` holds a stats answer (read when called) on
    its way back; ``hold`` holds every request before its first token."""

    def __init__(self) -> None:
        self.truth: dict[int, int] = {}
        self.log = KvEventLog(lambda: dict(self.truth))
        self.gate: asyncio.Event | None = None
        self.hold: asyncio.Event | None = None
        self.stats_error: BaseException | None = None
        self.answer: KvEventsReport | None = None  # a canned events report instead of the log's
        self.stats_calls = 0

    def store(self, *hashes: int) -> None:
        for h in hashes:
            self.truth[h] = GPU
        self.log.append(STORED, hashes, GPU)

    async def stats(self, timeout=5.0, *, events_since=None):
        self.stats_calls += 1
        if self.stats_error is not None:
            raise self.stats_error
        events = self.answer if self.answer is not None else self.log.report(events_since)
        gate = self.gate
        if gate is not None:
            await gate.wait()
        return PoolStatsReport(16, TierStats(64, 64, 0), TierStats(0, 0, 0), kv_events=events)

    async def generate(self, request, *, request_id, timeout=None):
        if self.hold is not None:
            await self.hold.wait()
        yield EngineChunk((1,), 1, KvMetrics(), True)

    async def close(self) -> None:
        pass


def _pool(n: int = 1) -> PoolSnapshot:
    return PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 1000, 0, 30,
                        tuple(ReplicaSnapshot(i, f"r{i}", f"127.0.0.1:{9000 + i}", "active", 1) for i in range(n)))


async def _route(n: int = 1, **config) -> tuple[Clock, PoolRoute, list[FakeEngine]]:
    clock = Clock()
    route = PoolRoute(_pool(n), RoutingConfig(**config), clock)
    fakes = []
    for replica in route.replicas.values():
        await replica.client.close()
        fake = FakeEngine()
        replica.client = fake
        fakes.append(fake)
    return clock, route, fakes


def _held(route: PoolRoute, replica: int, hashes) -> int:  # type: ignore[no-untyped-def]
    m = route.router.match(replica, tuple(hashes), now=0.0)
    return m.gpu_blocks + m.host_blocks


def test_a_report_that_does_not_start_at_the_cursor_is_not_applied_and_asks_for_a_snapshot() -> None:
    async def scenario() -> None:
        _, route, (fake,) = await _route()
        replica = route.replicas[0]
        fake.store(1, 2)
        await route.poll(replica)
        cursor = replica.cursor
        assert _held(route, 0, (1, 2)) == 2 and cursor > 0
        # an engine whose log skipped a record: the first record returned is not the cursor's
        fake.answer = KvEventsReport(fake.log.epoch, cursor + 2, [KvEventRecord(cursor + 1, STORED, (4,), GPU)])
        await route.poll(replica)
        assert replica.cursor == 0 and _held(route, 0, (4,)) == 0
        # an incremental report that ends before its next_seq lost its last records the same way
        fake.answer = None
        await route.poll(replica)  # the snapshot
        cursor = replica.cursor
        fake.answer = KvEventsReport(fake.log.epoch, cursor + 1, [])
        await route.poll(replica)
        assert replica.cursor == 0
        fake.answer = None
        fake.store(3)
        await route.poll(replica)  # snapshot: the mirror is the engine's cached set again
        assert _held(route, 0, (1, 2, 3)) == 3 and len(route.router.index(0)) == len(fake.truth)

    asyncio.run(scenario())


def test_an_engine_event_log_gap_never_costs_the_gateway_a_record() -> None:
    """The producer lost events (``invalidate``): the gateway resyncs and then sees every record."""

    async def scenario() -> None:
        _, route, (fake,) = await _route()
        replica = route.replicas[0]
        await route.poll(replica)
        fake.store(1)
        await route.poll(replica)
        for h in range(2, 8):
            if h % 3 == 0:
                fake.log.invalidate()
            fake.store(h)
            await route.poll(replica)
            assert len(route.router.index(0)) == len(fake.truth) == h
        assert _held(route, 0, range(1, 8)) == 7

    asyncio.run(scenario())


def test_a_poll_answered_after_the_breaker_opened_is_dropped() -> None:
    """The breaker opened (its index dropped, cursor 0) while a stats poll with the old cursor was
    on its way back: that answer neither closes the breaker nor lands on the emptied index."""

    async def scenario() -> None:
        clock, route, (fake,) = await _route()
        replica = route.replicas[0]
        fake.store(101, 102, 103)
        await route.poll(replica)
        assert _held(route, 0, (101, 102, 103)) == 3
        fake.store(104)
        fake.gate = asyncio.Event()
        poll = asyncio.create_task(route.poll(replica))
        await asyncio.sleep(0)
        route.mark_failed(replica)  # a dispatch found it unavailable meanwhile
        assert not replica.breaker.closed and replica.cursor == 0
        fake.gate.set()
        await poll
        fake.gate = None
        assert not replica.breaker.closed and replica.cursor == 0  # the stale answer changed nothing
        assert len(route.router.index(0)) == 0
        clock.now += 10.0
        await route.poll(replica)  # the probe: closes the breaker, the snapshot rebuilds the index
        assert replica.breaker.closed
        assert _held(route, 0, (101, 102, 103, 104)) == 4

    asyncio.run(scenario())


def test_a_stats_answer_that_cannot_be_read_is_a_failed_probe_not_an_error() -> None:
    async def scenario() -> None:
        clock, route, (fake,) = await _route()
        replica = route.replicas[0]
        fake.stats_error = TypeError("PoolStatsReport.__init__() got an unexpected keyword argument")
        await route.poll(replica)  # raises nothing
        assert not replica.breaker.closed
        fake.stats_error = None
        clock.now += 10.0
        fake.answer = KvEventsReport(fake.log.epoch, 2, snapshot={5: 7})  # a tier this gateway does not know
        await route.poll(replica)
        assert not replica.breaker.closed and replica.cursor == 0
        fake.answer = None
        fake.store(5)
        clock.now += 10.0
        await route.poll(replica)
        assert replica.breaker.closed and _held(route, 0, (5,)) == 1

    asyncio.run(scenario())


def test_a_report_with_an_event_kind_this_gateway_does_not_know_resyncs_from_a_snapshot() -> None:
    async def scenario() -> None:
        _, route, (fake,) = await _route()
        replica = route.replicas[0]
        fake.store(1)
        await route.poll(replica)
        newer = {"epoch": fake.log.epoch, "next_seq": replica.cursor + 1, "supported": True, "snapshot": None,
                 "events": [[replica.cursor, "pinned", [1], GPU]]}
        fake.answer = KvEventsReport.from_dict(newer)
        await route.poll(replica)
        assert replica.breaker.closed and replica.cursor == 0
        fake.answer = None
        fake.store(2)
        await route.poll(replica)
        assert replica.cursor > 0 and _held(route, 0, (1, 2)) == 2

    asyncio.run(scenario())


def test_a_breaker_that_opens_drops_the_index_but_not_the_load_of_requests_still_running() -> None:
    async def scenario() -> None:
        clock = Clock()
        routing = Routing(RoutingConfig(first_token_timeout_s=0), clock=clock)
        pool = _pool(2)
        route = routing.route(pool)
        fakes = {}
        for replica in route.replicas.values():
            await replica.client.close()
            fakes[replica.id] = replica.client = FakeEngine()
            fakes[replica.id].hold = asyncio.Event()
        await routing.poll(pool)

        async def serve(start: int) -> str:
            engine = routing.engine(pool)
            request = EngineRequest(tuple(range(start, start + 512)), 4, None, True, SamplingParams(),
                                    RetentionPlan(), None, None)
            async for _ in engine.generate(request, request_id=secrets.token_hex(4)):
                pass
            return engine.replica

        tasks = [asyncio.create_task(serve(1000 * i)) for i in range(1, 5)]
        await asyncio.sleep(0.05)
        busy = max(route.replicas.values(), key=lambda r: r.in_flight)
        before = route.router.load(busy.id, now=clock.now)
        assert busy.in_flight >= 1 and before.queued_prefill_tokens > 0 and before.running == busy.in_flight
        fakes[busy.id].store(77)
        await route.poll(busy)
        assert _held(route, busy.id, (77,)) == 1
        fakes[busy.id].stats_error = EngineUnavailable("stats call failed (a blip)")
        await routing.poll(pool)
        assert not busy.breaker.closed and busy.cursor == 0
        assert _held(route, busy.id, (77,)) == 0  # the index is gone (the cache may be too)...
        during = route.router.load(busy.id, now=clock.now)  # ...the requests running there are not
        assert (during.queued_prefill_tokens, during.running) == (before.queued_prefill_tokens, before.running)
        fakes[busy.id].stats_error = None
        clock.now += 1.0
        await routing.poll(pool)
        assert busy.breaker.closed and _held(route, busy.id, (77,)) == 1
        after = route.router.load(busy.id, now=clock.now)
        assert (after.queued_prefill_tokens, after.running) == (before.queued_prefill_tokens, before.running)
        for fake in fakes.values():
            fake.hold.set()
        await asyncio.gather(*tasks)
        done = route.router.load(busy.id, now=clock.now)  # their completions released it all
        assert (done.queued_prefill_tokens, done.active_blocks, done.running) == (0, 0, 0)
        # a replica removed from the registry is forgotten altogether
        route.sync(_pool(1))
        assert route.router.load(1, now=clock.now).running == 0

    asyncio.run(scenario())
