"""A conversation demote goes to the replica holding the conversation's blocks, never elsewhere:
elsewhere it would prefill the whole prefix at demote priority and leave the real blocks as they
were. Fake engine clients and a real pool route (no stack)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engines.contract import KvMetrics
from engines.kv_events import KvEventsReport
from engines.pool_stats import PoolStatsReport, TierStats
from retention.hashing import block_hashes
from retention.policy.planner import QuotaState, RetentionClassSpec, SegmentRetention
from retention.routing import Decision, RouteRequest
from server.gateway.admission import Limits
from server.gateway.api.conversation_demote import DeletedPrompt, send_demote
from server.gateway.api.prompting import PreparedPrompt
from server.gateway.context import TenantContext
from server.gateway.replicas.engine_client import EngineChunk
from server.gateway.replicas.routing import Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

TPB = 16
CLASS = RetentionClassSpec(SegmentRetention(90), SegmentRetention(60, 600_000), SegmentRetention(40, 30_000),
                           SegmentRetention(20, 30_000))


class FakeEngine:
    def __init__(self) -> None:
        self.got: list[int] = []  # prompt lengths received

    async def generate(self, request, *, request_id, timeout=None):
        self.got.append(len(request.input_ids))
        yield EngineChunk((1,), 1, KvMetrics(), True)

    async def stats(self, timeout=5.0, *, events_since=None):
        return PoolStatsReport(TPB, TierStats(1000, 1000, 0), TierStats(0, 0, 0))

    async def close(self) -> None:
        pass


def _pool(state0: str = "active") -> PoolSnapshot:
    return PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", TPB, 1000, 0, 30,
                        (ReplicaSnapshot(0, "r0", "127.0.0.1:9000", state0, 1),
                         ReplicaSnapshot(1, "r1", "127.0.0.1:9001", "active", 1)))


async def _setup(salt: str = "salt"):  # type: ignore[no-untyped-def]
    routing = Routing(RoutingConfig(), clock=lambda: 100.0)
    pool = _pool()
    route = routing.route(pool)
    fakes = {}
    for replica in route.replicas.values():
        await replica.client.close()
        fakes[replica.id] = replica.client = FakeEngine()
    tenant = TenantContext(7, "t", "active", "salted", salt, Limits(), 1.0, pool, CLASS, 1)
    tokens = tuple(range(500, 500 + 20 * TPB))
    hashes = tuple(block_hashes(tokens, TPB, salt=tenant.engine_salt))
    # r0 holds the conversation's 20 blocks (its KV events say so), r1 none of them ...
    route._feed(route.replicas[0], KvEventsReport("e0", 2, snapshot={h: 0 for h in hashes}))
    route._feed(route.replicas[1], KvEventsReport("e1", 1, snapshot={}))
    # ... and r0 served more prompt tokens of other traffic lately: past the balance band
    for rid, n in ((0, 3072), (1, 1024)):
        route.router.on_dispatch(RouteRequest(f"bg{rid}", (), n, 1), Decision(rid, "kv-aware"), now=100.0)
        route.router.on_complete(f"bg{rid}", now=100.0)
    services = SimpleNamespace(routing=routing, engines=SimpleNamespace(seen=lambda p: p),
                               monitor=SimpleNamespace(quota_state=lambda pool, tenant_id: QuotaState()))
    deleted = DeletedPrompt("m", PreparedPrompt(tokens, 2 * TPB, 2 * TPB), SimpleNamespace(eos_token_id=None), hashes)
    return routing, pool, route, fakes, tenant, services, deleted


def test_the_demote_goes_to_the_replica_holding_the_blocks_even_when_it_is_the_busier_one() -> None:
    async def scenario() -> None:
        routing, pool, route, fakes, tenant, services, deleted = await _setup()
        outcome = await send_demote(services, tenant, deleted, start_block=4)
        assert outcome == "sent"
        assert fakes[0].got == [min(20 * TPB, len(deleted.prompt.input_ids) - 1) + 1] and fakes[1].got == []
        # the demote's load is released (it ended), and ordinary requests still go by the cost
        assert route.router.load(0, now=100.0).running == 0
        await routing.close()

    asyncio.run(scenario())


def test_no_demote_when_no_replica_holding_the_blocks_can_take_it() -> None:
    async def scenario() -> None:
        routing, pool, route, fakes, tenant, services, deleted = await _setup()
        route.sync(_pool(state0="draining"))  # the holder drains: no new request goes there
        outcome = await send_demote(services, tenant, deleted, start_block=4)
        assert outcome == "holder_unavailable"
        assert fakes[0].got == [] and fakes[1].got == []
        await routing.close()

    asyncio.run(scenario())
