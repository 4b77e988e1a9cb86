"""Routing sync over a real Redis (``server/gateway/replicas/peer_sync.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest
from pydantic import ValidationError

from retention.routing import KvAwareRouter, Notice, PeerLoads, RoutingError
from server.gateway.replicas import peer_sync
from server.gateway.replicas.peer_sync import PeerSync
from server.settings import Settings

REDIS = "redis://127.0.0.1:6379/0"
POOL = "p"


OTHER = "q"


def gateway(name: str, namespace: str, lease_s: float = 15.0) -> tuple[PeerSync, PeerLoads, PeerLoads]:
    """A gateway routing two pools (POOL, OTHER), each with its own router's peer loads."""
    sync = PeerSync(REDIS, namespace=namespace, gateway=name, lease_s=lease_s)
    loads = {pool: PeerLoads(KvAwareRouter(tokens_per_block=4), name, lease_s=lease_s) for pool in (POOL, OTHER)}
    sync.attach(peers_of=loads.get, pools=lambda: [POOL, OTHER], clock=time.monotonic)
    return sync, loads[POOL], loads[OTHER]


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def two_gateways():
    """Gateways "a" and "b" in a fresh namespace, started and subscribed; closed on the way out."""
    ns = f"test-{secrets.token_hex(4)}"
    a, b = gateway("a", ns), gateway("b", ns)
    for sync, _, _ in (a, b):
        sync.start()
    try:
        await until(lambda: a[0].subscribed.is_set() and b[0].subscribed.is_set(), "subscriptions")
        yield a, b
    finally:
        await a[0].close()
        await b[0].close()


def test_peers_apply_each_others_dispatches_through_redis() -> None:
    async def scenario() -> None:
        async with two_gateways() as ((a, a_loads, _), (b, b_loads, b_other)):
            a.publish(POOL, Notice("a", "dispatch", "req-1", 1, (7, 8, 9), 13, 4, 0))
            await until(lambda: b_loads.router.loads.load(1).running == 1, "b sees a's dispatch")
            assert b_loads.router.match(1, (7, 8, 9), now=0.0).pending_blocks == 3
            assert a_loads.router.loads.load(1).running == 0  # a's own notice comes back: ignored
            received = a.counters.received
            a.deliver(a.channel(POOL), Notice("a", "dispatch", "req-9", 1, (7,), 5, 4, 0).encode())
            assert a.counters.received == received  # dropped before parsing: not even counted
            a.publish(POOL, Notice("a", "complete", "req-1"))
            await until(lambda: b_loads.router.loads.load(1).running == 0, "b sees a's completion")
            assert b_loads.in_flight() == 0
            # each pool's notices reach that pool's router only
            a.publish(OTHER, Notice("a", "dispatch", "req-2", 1, (1,), 5, 4, 0))
            await until(lambda: b_other.router.loads.load(1).running == 1, "b's other pool sees it")
            assert b_loads.router.loads.load(1).running == 0 and b_loads.in_flight() == 0
            # a's heartbeat names what a has in flight: req-2 in OTHER, nothing in POOL
            a.beat()
            await until(lambda: b_other.peers() == ["a"] and b_loads.peers() == ["a"], "a's heartbeats")
            assert b_other.in_flight() == 1
            # garbage on the channel is counted and dropped
            await a._redis.publish(a.channel(POOL), b"not a notice")
            await until(lambda: b.counters.malformed == 1, "b reads the garbage")
            assert a.counters.dropped == 0 and a.counters.published >= 4

    asyncio.run(scenario())


def test_a_dropped_first_token_is_repaired_by_the_next_heartbeat(monkeypatch) -> None:
    async def scenario() -> None:
        async with two_gateways() as ((a, _, _), (b, b_loads, _)):
            a.publish(POOL, Notice("a", "dispatch", "req-1", 1, (7, 8), 13, 4, 0))
            await until(lambda: b_loads.router.loads.load(1).running == 1, "b sees a's dispatch")
            assert b_loads.router.loads.load(1).queued_prefill_tokens == 13
            monkeypatch.setattr(peer_sync, "QUEUE_MAX_HASHES", 0)  # the queue "full": all but heartbeats dropped
            a.publish(POOL, Notice("a", "first_token", "req-1"))
            assert a.counters.dropped == 1
            a.beat()  # names req-1 in flight and decoding
            await until(lambda: b_loads.router.loads.load(1).queued_prefill_tokens == 0, "the heartbeat's repair")
            assert b_loads.router.loads.load(1).running == 1

    asyncio.run(scenario())


def test_a_gateway_gone_silent_leaves_its_peers_load_within_the_lease() -> None:
    async def scenario() -> None:
        ns = f"test-{secrets.token_hex(4)}"
        (a, _, _), (b, b_loads, _) = gateway("a", ns, lease_s=0.6), gateway("b", ns, lease_s=0.6)
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
            for i in range(100):
                sync.publish(POOL, Notice("alone", "complete", f"r{i}"))
            await until(lambda: sync.counters.dropped >= 100, "the failed batch counted", timeout=15.0)
            assert sync.counters.published == 0 and not sync.subscribed.is_set()
            # while sending fails, notices are dropped at once, only heartbeats still queue (to find Redis back)
            dropped = sync.counters.dropped
            sync.publish(POOL, Notice("alone", "dispatch", "x", 0, (1,), 5, 4, 0))
            assert sync.counters.dropped == dropped + 1
            sync.beat()
            assert sync.counters.dropped == dropped + 1
        finally:
            await sync.close()

    asyncio.run(scenario())


def test_routing_sync_needs_redis() -> None:
    with pytest.raises(ValidationError, match="routing_sync needs redis_url"):
        Settings(routing_sync=True)
    assert Settings(routing_sync=True, redis_url=REDIS).routing_sync


def test_a_quiet_subscription_is_kept_alive_by_its_pings_and_a_refused_notice_never_ends_it() -> None:
    class Refusing:
        def apply(self, notice: Notice, *, now: float) -> None:
            raise RoutingError("refused")

    async def scenario() -> None:
        sync = PeerSync(REDIS, namespace=f"test-{secrets.token_hex(4)}", gateway="quiet", lease_s=0.9)
        sync.attach(peers_of=lambda pool: Refusing(), pools=list, clock=time.monotonic)  # no pool: no heartbeat
        sync.start()
        try:
            await until(lambda: sync.subscribed.is_set(), "subscription")
            await asyncio.sleep(2.5)  # nearly three leases without a message: its PINGs are answered
            assert sync.resubscribes == 0 and sync.subscribed.is_set()
            await sync._redis.publish(sync.channel(POOL), Notice("peer", "complete", "x").encode())
            await until(lambda: sync.counters.malformed == 1, "the refused notice counted")
            assert sync.counters.received == 0 and sync.resubscribes == 0 and sync.subscribed.is_set()
        finally:
            await sync.close()

    asyncio.run(scenario())


def test_a_bad_message_never_ends_the_subscription_and_the_next_notice_is_applied() -> None:
    """Too deeply nested to parse, on a channel whose name is not UTF-8, over the size bound, past a
    notice's bounds: each is counted malformed, the subscription stays, the notice behind them lands."""
    async def scenario() -> None:
        async with two_gateways() as ((a, _, _), (b, b_loads, _)):
            await a._redis.publish(a.channel(POOL), b"[" * 100_000 + b"]" * 100_000)
            await a._redis.publish(f"{a.namespace}:routing:".encode() + b"\xff", b"[]")
            await a._redis.publish(a.channel(POOL), Notice("a", "dispatch", "big", 1, tuple(range(2_000_000)),
                                                           8_000_000, 4, 0).encode())  # ~15 MB
            await a._redis.publish(a.channel(POOL), Notice("a", "dispatch", "x", 1, (1,), 10**30, 4, 0).encode())
            await a._redis.publish(a.channel(POOL), Notice("a", "dispatch", "y", 10**30, (1,), 5, 4, 0).encode())
            await a._redis.publish(a.channel(POOL), Notice("a", "dispatch", "req-1", 1, (7, 8), 13, 4, 0).encode())
            await until(lambda: b_loads.router.loads.load(1).running == 1, "the notice behind them", timeout=5.0)
            assert b.counters.malformed == 5  # (received also counts a's heartbeats)
            assert b.resubscribes == 0 and b.subscribed.is_set()
            assert b_loads.router.loads.load(1).queued_prefill_tokens == 13

    asyncio.run(scenario())


def test_deliver_counts_any_failure_of_one_message_as_malformed(monkeypatch) -> None:
    class Failing:
        def apply(self, notice: Notice, *, now: float) -> None:
            raise KeyError("a bug while applying")

    sync, loads, _ = gateway("b", "unused")
    sync.deliver(sync.channel(POOL), b"[" * 100_000 + b"]" * 100_000)
    sync.deliver(f"{sync.namespace}:routing:".encode() + b"\xff", b"[]")
    sync.deliver(sync.channel(POOL).encode(), Notice("a", "dispatch", "r", 1, (1,), 5, 4, 0).encode())  # bytes: fine
    assert (sync.counters.malformed, sync.counters.received) == (2, 1)
    assert loads.router.loads.load(1).running == 1

    def parse(_data):
        raise AssertionError("an oversize message was parsed")

    big = Notice("a", "dispatch", "big", 1, tuple(range(2_000_000)), 8_000_000, 4, 0).encode()  # ~15 MB
    monkeypatch.setattr("retention.routing.sync.json.loads", parse)
    started = time.perf_counter()
    sync.deliver(sync.channel(POOL), big)
    assert sync.counters.malformed == 3 and time.perf_counter() - started < 0.1
    monkeypatch.undo()
    sync.attach(peers_of=lambda pool: Failing(), pools=list, clock=time.monotonic)
    sync.deliver(sync.channel(POOL), Notice("a", "complete", "r").encode())
    assert sync.counters.malformed == 4


def test_an_unexpected_error_in_the_listener_is_counted_as_a_resubscribe(monkeypatch) -> None:
    async def scenario() -> None:
        async with two_gateways() as ((a, _, _), (b, b_loads, _)):
            deliver = b.deliver
            failures = []

            def failing_once(channel, data) -> None:
                if not failures:
                    failures.append(channel)
                    raise RuntimeError("an unexpected error")
                deliver(channel, data)

            monkeypatch.setattr(peer_sync, "RETRY_S", 0.05)
            monkeypatch.setattr(b, "deliver", failing_once)
            a.publish(POOL, Notice("a", "complete", "nothing"))
            await until(lambda: b.resubscribes == 1 and b.subscribed.is_set(), "the listener back, counted")
            a.publish(POOL, Notice("a", "dispatch", "req-1", 1, (7, 8), 13, 4, 0))
            await until(lambda: b_loads.router.loads.load(1).running == 1, "b applies what follows", timeout=5.0)

    asyncio.run(scenario())
