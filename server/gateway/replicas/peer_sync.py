"""Routing sync between gateway replicas over Redis pub/sub (``KVGATE_ROUTING_SYNC``).

The notices and what a peer does with them are pure (``retention/routing/sync.py``); this
module carries them. One channel per pool, ``<namespace>:routing:<pool>``::

    RoutedEngine hook ──► publish(pool, notice) ──► bounded queue ──► sender task: encode,
                                                                      one pipeline per batch
    Redis ──► psubscribe <namespace>:routing:* ──► listener task ──► the pool's PeerLoads.apply
    every lease_s / 3, per pool: a heartbeat naming this gateway's requests in flight there and
    those past their first token (peers drop what it does not name and stop counting the named
    decoding ones' prefill as queued), then expiry of peers silent for lease_s

Invariants:

* A request never waits for Redis: ``publish`` only enqueues (encoding happens in the sender);
  a full queue (``QUEUE_MAX`` notices or ``QUEUE_MAX_HASHES`` block hashes; heartbeats are
  exempt from the latter) drops the notice and counts it; while sending fails, only heartbeats
  are queued and what was queued is dropped. A dropped COMPLETE is repaired by the next
  heartbeat, a dropped DISPATCH costs only the sync, a dropped FIRST_TOKEN keeps the request's
  prefill queued in peers' load until the next heartbeat (which names it decoding) or its COMPLETE.
* Each gateway's notices leave in the order they were published (one sender), so a heartbeat
  names every request whose DISPATCH went before it and is still in flight.
* Redis being away costs the sync, never a request: after a failed send the sender pings every
  ``RETRY_S`` until Redis answers; the listener resubscribes when its connection fails or when it
  heard nothing, not even the answer to its PING, for ``lease_s`` (a hung connection); every
  loop outlives an unexpected error (the listener's counts as a resubscribe).
* A bad message never ends the subscription: one over ``MAX_NOTICE_BYTES`` (not parsed), one on a
  channel whose name is not UTF-8, one that is not a notice or is past a notice's bounds (block
  hashes, token counts, replica id: ``retention/routing/sync.py``), one the router refuses, or any
  error while applying one is counted malformed and skipped; the next message is read as usual.
  So one message costs a bounded time (~50 ms at most to parse, ~25 ms to apply the largest
  dispatch), and this gateway never sends what its peers would refuse (a notice over
  ``MAX_NOTICE_BYTES``, which only a heartbeat naming ~50,000 requests could be, is dropped).
* This gateway's own notices, echoed back by the subscription, are dropped before parsing
  (``received`` counts peers' notices only).
* A peer's notice for a pool this gateway has not polled yet is dropped (its route does not
  exist; its load starts over). A restarted gateway takes a new id, so what its previous life
  had in flight leaves peers' load within ``lease_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from retention.routing import Notice, PeerLoads, RoutingError
from retention.routing.sync import MAX_NOTICE_BYTES
from server.gateway.tasks import cancel_all

log = logging.getLogger("kvgate.gateway.peer_sync")

RETRY_S = 1.0
QUEUE_MAX = 10_000
QUEUE_MAX_HASHES = 1_000_000  # block hashes of queued notices: ~45 MB of int objects at most waiting for Redis
REDIS_TIMEOUT_S = 2.0
YIELD_EVERY = 64  # messages applied between two turns of the event loop
YIELD_BYTES = 2**18  # or message bytes read since the last turn (~6 ms of parsing; one notice may hold ~50 ms)
WARN_EVERY_S = 60.0  # at most one log line per this for messages that failed unexpectedly


@dataclass(slots=True)
class SyncCounters:
    published: int = 0
    received: int = 0  # peers' notices parsed (this gateway's own echoes are not)
    dropped: int = 0  # queue full, or Redis away when the notice was to be sent
    malformed: int = 0  # not a notice (or past its bounds, or on a channel not UTF-8), or one the router refused


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
        # Two clients: publishing is bounded by a short socket timeout; the subscription polls with
        # get_message and is watched by its own PINGs (``_listen``).
        self._redis = redis_asyncio.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
        self._sub_redis = redis_asyncio.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S)
        self._down = (RedisError, OSError, asyncio.TimeoutError)
        self.gateway = gateway or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._echo = json.dumps([self.gateway])[:-1].encode() + b","  # how this gateway's own notices start
        self.namespace = namespace
        self.lease_s = lease_s
        self._clock: Callable[[], float] = time.monotonic
        self._queue: asyncio.Queue[tuple[str, Notice]] = asyncio.Queue(maxsize=QUEUE_MAX)
        self._queued_hashes = 0
        self._own: dict[str, dict[str, bool]] = {}  # pool -> this gateway's requests in flight there -> past first token
        self._failing = False  # the last send failed: only heartbeats are queued until one goes through
        self.resubscribes = 0  # subscriptions made again after a failure or a quiet lease
        self.counters = SyncCounters()
        self.peers_of: Callable[[str], PeerLoads | None] = lambda _pool: None
        self.pools: Callable[[], list[str]] = list
        self._tasks: list[asyncio.Task] = []
        self.subscribed = asyncio.Event()  # set once Redis confirmed the subscription, cleared when lost
        self._warned_at = -WARN_EVERY_S  # when a message that failed unexpectedly was last logged

    def attach(self, *, peers_of: Callable[[str], PeerLoads | None], pools: Callable[[], list[str]],
               clock: Callable[[], float]) -> None:
        self.peers_of, self.pools, self._clock = peers_of, pools, clock

    def channel(self, pool: str) -> str:
        return f"{self.namespace}:routing:{pool}"

    # ------------------------------------------------------------------ sending
    def publish(self, pool: str, notice: Notice) -> None:
        """Queue ``notice`` for ``pool``'s channel; never blocks, never raises."""
        own = self._own.setdefault(pool, {})
        if notice.kind == "dispatch":  # a retry's dispatch prefills again
            own[notice.request_id] = False
        elif notice.kind == "first_token":
            if notice.request_id in own:
                own[notice.request_id] = True
        elif notice.kind == "complete":
            own.pop(notice.request_id, None)
        if notice.kind != "heartbeat" and (self._failing or self._queued_hashes >= QUEUE_MAX_HASHES):
            self.counters.dropped += 1
            return
        try:
            self._queue.put_nowait((pool, notice))
        except asyncio.QueueFull:
            self.counters.dropped += 1
            return
        self._queued_hashes += len(notice.hashes)

    def _take(self) -> tuple[str, Notice]:
        pool, notice = self._queue.get_nowait()
        self._queued_hashes -= len(notice.hashes)
        return pool, notice

    async def _send(self) -> None:
        while True:
            batch = [await self._queue.get()]
            self._queued_hashes -= len(batch[0][1].hashes)
            while not self._queue.empty() and len(batch) < 512:
                batch.append(self._take())
            encoded = [(self.channel(pool), notice.encode()) for pool, notice in batch]
            sendable = [(channel, raw) for channel, raw in encoded if len(raw) <= MAX_NOTICE_BYTES]
            if len(sendable) < len(encoded):  # peers would refuse it unread
                self.counters.dropped += len(encoded) - len(sendable)
                log.warning("routing sync: dropped %d notice(s) over %d bytes (peers refuse them)",
                            len(encoded) - len(sendable), MAX_NOTICE_BYTES)
                if not sendable:
                    continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for channel, raw in sendable:
                        pipe.publish(channel, raw)
                    await pipe.execute()
            except self._down as exc:
                stale = [self._take() for _ in range(self._queue.qsize())]
                self.counters.dropped += len(batch) + len(stale)
                log.warning("routing sync: publishing failed (%s); peers route without this gateway's "
                            "dispatches until Redis answers", exc)
                self._failing = True
                await self._until_redis_answers()
                log.warning("routing sync: publishing restored")
                continue
            self.counters.published += len(sendable)

    async def _until_redis_answers(self) -> None:
        """Ping every ``RETRY_S`` until Redis answers, then queue everything again."""
        while True:
            await asyncio.sleep(RETRY_S)
            with contextlib.suppress(*self._down):
                await self._redis.ping()
                self._failing = False
                return

    # ------------------------------------------------------------------ receiving
    def deliver(self, channel: str | bytes, data: bytes) -> None:
        """Apply one message of ``channel`` to its pool's peer loads (this gateway's own, which the
        subscription echoes back, are dropped before parsing: ``Notice.encode`` starts with the id).
        Never raises: a message that cannot be read or applied is counted malformed."""
        try:
            if data.startswith(self._echo):
                return
            if isinstance(channel, bytes):
                channel = channel.decode()  # not UTF-8: names no pool of this gateway's, counted malformed
            prefix = f"{self.namespace}:routing:"
            pool = channel[len(prefix):] if channel.startswith(prefix) else None
            notice = Notice.decode(data)  # refuses a message over MAX_NOTICE_BYTES before parsing it
            peers = None if pool is None else self.peers_of(pool)
            if peers is not None:
                peers.apply(notice, now=self._clock())
        except (RoutingError, UnicodeDecodeError):  # not a notice, or parsed but refused (a peer of another version)
            self.counters.malformed += 1
            return
        except Exception:  # noqa: BLE001 -- one message never ends the subscription
            self.counters.malformed += 1
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning("routing sync: a message on %r failed; skipped (counted malformed)", channel,
                            exc_info=True)
            return
        self.counters.received += 1

    async def _listen(self) -> None:
        """One subscription until it fails or goes quiet: a second (at most a quarter lease) without
        messages sends a PING on it, and a lease without any answer (a hung connection) ends it."""
        pubsub = self._sub_redis.pubsub()
        try:
            await pubsub.psubscribe(f"{self.namespace}:routing:*")
            heard = self._clock()
            pinged = False
            applied = read = 0
            wait = min(1.0, self.lease_s / 4)  # a PING and its answer fit in a lease
            while True:
                message = await pubsub.get_message(timeout=wait)
                now = self._clock()
                if message is None:
                    if now - heard > self.lease_s:
                        log.warning("routing sync: the subscription answered nothing for %.0f s; subscribing again",
                                    self.lease_s)
                        return
                    if not pinged:
                        await pubsub.ping()
                        pinged = True
                    continue
                heard, pinged = now, False
                kind = message.get("type")
                if kind == "psubscribe":
                    self.subscribed.set()
                elif kind == "pmessage":
                    data = message["data"]
                    self.deliver(message["channel"], data)
                    applied += 1
                    read += len(data)
                    if applied % YIELD_EVERY == 0 or read >= YIELD_BYTES:
                        read = 0
                        await asyncio.sleep(0)  # a burst never holds the event loop
        finally:
            self.subscribed.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _subscription(self) -> None:
        lost = False
        while True:
            try:
                await self._listen()
            except self._down as exc:
                if not lost:
                    log.warning("routing sync: subscription lost (%s); routing on this gateway's own view", exc)
                lost = True
            except Exception:
                log.exception("routing sync: the subscription failed; subscribing again")
                lost = False
            else:
                lost = False
            self.resubscribes += 1
            await asyncio.sleep(RETRY_S)

    # ------------------------------------------------------------------ liveness
    def beat(self) -> None:
        """One heartbeat per pool naming this gateway's requests in flight there (and those past
        their first token), then expiry of silent peers."""
        now = self._clock()
        for pool in self.pools():
            own = self._own.get(pool, {})
            self.publish(pool, Notice(self.gateway, "heartbeat", in_flight=tuple(own),
                                      decoding=tuple(rid for rid, decoding in own.items() if decoding)))
            peers = self.peers_of(pool)
            if peers is not None:
                for gone in peers.expire(now=now):
                    log.warning("routing sync: gateway %s silent for %.0f s; its requests leave pool %s's load",
                                gone, self.lease_s, pool)

    async def _beat(self) -> None:
        while True:
            self.beat()
            await asyncio.sleep(self.lease_s / 3)

    async def _supervised(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """``run`` again after any unexpected error: the sync must outlive one bad iteration."""
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("routing sync: %s failed; restarting it", name)
                await asyncio.sleep(RETRY_S)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._supervised(name, run)) for name, run in
                       (("sender", self._send), ("subscription", self._subscription), ("heartbeat", self._beat))]

    async def close(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        for client in (self._redis, self._sub_redis):
            with contextlib.suppress(Exception):
                await client.aclose()
