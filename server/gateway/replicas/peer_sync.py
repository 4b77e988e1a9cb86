"""Routing sync between gateway replicas over Redis pub/sub (``KVGATE_ROUTING_SYNC``).

The notices and what a peer does with them are pure (``retention/routing/sync.py``); this
module carries them. One channel per pool, ``<namespace>:routing:<pool>``::

    RoutedEngine hook ──► publish(pool, notice) ──► bounded queue ──► publisher task
                                                                       (one pipeline per batch)
    Redis ──► psubscribe <namespace>:routing:* ──► listener task ──► the pool's PeerLoads.apply
    every lease_s / 3: a heartbeat per pool; peers silent for lease_s expire (their load leaves)

Invariants: a request never waits for Redis (``publish`` only enqueues; a full queue drops
the notice and counts it); Redis being away costs the sync, never a request: publisher and
listener reconnect every ``RETRY_S``, and meanwhile each gateway routes on its own view. A
peer's notice for a pool this gateway has not polled yet is dropped (its route does not
exist; its load starts over). A restarted gateway takes a new id, so what its previous
life had in flight leaves peers' load within ``lease_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from retention.routing import Notice, PeerLoads, RoutingError

log = logging.getLogger("kvgate.gateway.peer_sync")

RETRY_S = 1.0
QUEUE_MAX = 10_000
REDIS_TIMEOUT_S = 2.0


@dataclass(slots=True)
class SyncCounters:
    published: int = 0
    received: int = 0
    dropped: int = 0  # queue full, or Redis away when the batch was sent
    malformed: int = 0


class PeerSync:
    """This gateway's routing notices to its peers, theirs to its pools' :class:`PeerLoads`.

    :meth:`attach` (``Routing`` calls it) says where notices go: ``peers_of(pool)`` is the
    pool's ``PeerLoads`` (None while this gateway has no route for it), ``pools()`` the pools
    it routes, ``clock`` the routing clock notices are applied at.
    """

    def __init__(self, url: str, *, namespace: str = "kvgate", gateway: str | None = None,
                 lease_s: float = 15.0) -> None:
        import redis.asyncio as redis_asyncio
        from redis.exceptions import RedisError

        if not lease_s > 0:
            raise ValueError("lease_s must be > 0")
        self._url = url
        self._redis = redis_asyncio.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S)
        self._down = (RedisError, OSError, asyncio.TimeoutError)
        self.gateway = gateway or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.namespace = namespace
        self.lease_s = lease_s
        self._clock: Callable[[], float] = time.monotonic
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=QUEUE_MAX)
        self.counters = SyncCounters()
        self.peers_of: Callable[[str], PeerLoads | None] = lambda _pool: None
        self.pools: Callable[[], list[str]] = list
        self._tasks: list[asyncio.Task] = []
        self.subscribed = asyncio.Event()  # set while the listener is subscribed (tests, readiness)

    def attach(self, *, peers_of: Callable[[str], PeerLoads | None], pools: Callable[[], list[str]],
               clock: Callable[[], float]) -> None:
        self.peers_of, self.pools, self._clock = peers_of, pools, clock

    def channel(self, pool: str) -> str:
        return f"{self.namespace}:routing:{pool}"

    # ------------------------------------------------------------------ sending
    def publish(self, pool: str, notice: Notice) -> None:
        """Queue ``notice`` for ``pool``'s channel; never blocks."""
        try:
            self._queue.put_nowait((self.channel(pool), notice.encode()))
        except asyncio.QueueFull:
            self.counters.dropped += 1

    async def _send(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 512:
                batch.append(self._queue.get_nowait())
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for channel, data in batch:
                        pipe.publish(channel, data)
                    await pipe.execute()
                self.counters.published += len(batch)
            except self._down as exc:
                self.counters.dropped += len(batch)
                log.warning("routing sync: publish failed (%s); peers miss %d notices", exc, len(batch))
                await asyncio.sleep(RETRY_S)

    # ------------------------------------------------------------------ receiving
    def deliver(self, channel: str, data: bytes) -> None:
        """Apply one message of ``channel`` to its pool's peer loads."""
        prefix = f"{self.namespace}:routing:"
        pool = channel[len(prefix):] if channel.startswith(prefix) else None
        peers = None if pool is None else self.peers_of(pool)
        try:
            notice = Notice.decode(data)
        except RoutingError:
            self.counters.malformed += 1
            return
        self.counters.received += 1
        if peers is not None:
            peers.apply(notice, now=self._clock())

    async def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(f"{self.namespace}:routing:*")
                self.subscribed.set()
                async for message in pubsub.listen():
                    if message.get("type") == "pmessage":
                        channel = message["channel"]
                        self.deliver(channel.decode() if isinstance(channel, bytes) else channel, message["data"])
            except self._down as exc:
                log.warning("routing sync: subscription lost (%s); routing on this gateway's own view", exc)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_S)

    # ------------------------------------------------------------------ liveness
    def beat(self) -> None:
        """One heartbeat per pool, and expiry of silent peers."""
        now = self._clock()
        for pool in self.pools():
            self.publish(pool, Notice(self.gateway, "heartbeat"))
            peers = self.peers_of(pool)
            if peers is not None:
                for gone in peers.expire(now=now):
                    log.warning("routing sync: gateway %s silent for %.0f s; its requests leave pool %s's load",
                                gone, self.lease_s, pool)

    async def _beat(self) -> None:
        while True:
            self.beat()
            await asyncio.sleep(self.lease_s / 3)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._listen()),
                       asyncio.create_task(self._beat())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        with contextlib.suppress(Exception):
            await self._redis.aclose()
