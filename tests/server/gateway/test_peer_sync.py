"""Routing sync over a real Redis (``server/gateway/replicas/peer_sync.py``)."""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time

import pytest
from pydantic import ValidationError

from retention.routing import KvAwareRouter, Notice, PeerLoads
from server.gateway.replicas.peer_sync import PeerSync
from server.settings import Settings

REDIS = "redis://127.0.0.1:6379/0"
POOL = "p"


def gateway(name: str, namespace: str, lease_s: float = 15.0) -> tuple[PeerSync, PeerLoads]:
    sync = PeerSync(REDIS, namespace=namespace, gateway=name, lease_s=lease_s)
    loads = PeerLoads(KvAwareRouter(tokens_per_block=4), name, lease_s=lease_s)
    sync.attach(peers_of=lambda pool: loads if pool == POOL else None, pools=lambda: [POOL], clock=time.monotonic)
    return sync, loads


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_peers_apply_each_others_dispatches_through_redis() -> None:
    async def scenario() -> None:
        ns = f"test-{secrets.token_hex(4)}"
        (a, a_loads), (b, b_loads) = gateway("a", ns), gateway("b", ns)
        for sync in (a, b):
            sync.start()
        try:
            await until(lambda: a.subscribed.is_set() and b.subscribed.is_set(), "subscriptions")
            a.publish(POOL, Notice("a", "dispatch", "req-1", 1, (7, 8, 9), 13, 4, 0))
            await until(lambda: b_loads.router.loads.load(1).running == 1, "b sees a's dispatch")
            assert b_loads.router.match(1, (7, 8, 9), now=0.0).pending_blocks == 3
            assert a_loads.router.loads.load(1).running == 0  # a's own notice comes back: ignored
            a.publish(POOL, Notice("a", "complete", "req-1"))
            await until(lambda: b_loads.router.loads.load(1).running == 0, "b sees a's completion")
            assert b_loads.in_flight() == 0
            # garbage on the channel and notices for a pool b does not route are dropped, counted
            await a._redis.publish(a.channel(POOL), b"not a notice")
            a.publish("other-pool", Notice("a", "dispatch", "req-2", 1, (1,), 5, 4, 0))
            await until(lambda: b.counters.malformed == 1 and b.counters.received >= 4, "b reads the rest")
            assert b_loads.in_flight() == 0 and a.counters.published >= 3 and a.counters.dropped == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_gateway_gone_silent_leaves_its_peers_load_within_the_lease() -> None:
    async def scenario() -> None:
        ns = f"test-{secrets.token_hex(4)}"
        (a, _), (b, b_loads) = gateway("a", ns, lease_s=0.6), gateway("b", ns, lease_s=0.6)
        for sync in (a, b):
            sync.start()
        try:
            await until(lambda: a.subscribed.is_set() and b.subscribed.is_set(), "subscriptions")
            a.publish(POOL, Notice("a", "dispatch", "held", 0, (1, 2), 9, 4, 0))
            await until(lambda: b_loads.router.loads.load(0).running == 1, "b sees a's dispatch")
            await a.close()  # a crashes: no completion, no more heartbeats
            started = time.monotonic()
            await until(lambda: b_loads.router.loads.load(0).running == 0, "a's expiry", timeout=5.0)
            assert time.monotonic() - started >= 0.2  # not at once: heartbeats kept it alive until then
            assert b_loads.peers() == []
        finally:
            await b.close()

    asyncio.run(scenario())


def test_redis_away_never_blocks_or_fails_a_publish() -> None:
    async def scenario() -> None:
        sync = PeerSync("redis://127.0.0.1:1/0", gateway="alone")  # nothing listens on port 1
        sync.attach(peers_of=lambda pool: None, pools=lambda: [POOL], clock=time.monotonic)
        sync.start()
        try:
            assert not inspect.iscoroutinefunction(sync.publish)  # a request never awaits Redis
            for i in range(100):
                sync.publish(POOL, Notice("alone", "complete", f"r{i}"))
            await until(lambda: sync.counters.dropped >= 100, "the failed batch counted", timeout=15.0)
            assert sync.counters.published == 0 and not sync.subscribed.is_set()
        finally:
            await sync.close()

    asyncio.run(scenario())


def test_routing_sync_needs_redis() -> None:
    with pytest.raises(ValidationError, match="routing_sync needs redis_url"):
        Settings(routing_sync=True)
    assert Settings(routing_sync=True, redis_url=REDIS).routing_sync
