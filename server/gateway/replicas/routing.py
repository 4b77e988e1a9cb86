"""The gateway's side of routing: replicas, their health, their KV events, the dispatch.

The choice itself is pure and lives in ``retention/routing/`` (cost, indexes, load); this
module feeds it and carries it out::

    poll loop (PoolMonitor, every ~1 s)            request (RoutedEngine.generate)
      per pool: sync replica set from registry       hashes = block_hashes(prompt, salt)
      per replica: stats + kv_events_since cursor    a timed-out replica's trial due? → it alone
        ├─ events → router index (precise)           else candidates = active ∧ breaker closed
        ├─ unsupported → approximate index           decision = router.route(...)
        ├─ failure → breaker opens (out of rotation) on_dispatch → stream from replica
        └─ success → breaker closes (back in),       first token → on_prefill_done, breaker
           unless the replica timed out (then only     closes (the replica serves)
           a served request closes it: breaker.py)   end → on_complete (load released)
      sum of replicas' per-tenant blocks → quotas    unavailable, or no first token within
                                                     first_token_timeout_s (call cancelled) →
                                                     retry once elsewhere (breaker opens on
                                                     the failed one); after the first token,
                                                     silent for inter_token_timeout_s → call
                                                     cancelled, breaker times out, the
                                                     consumer gets EngineStalled (a
                                                     restartable one: EngineRestart)

Invariants:

* A request is only dispatched to a replica whose registry state is ``active`` and whose
  breaker is closed, or as the one trial of a replica that timed out (``breaker.py``); when
  no such replica exists, to an ``active`` one whose breaker opened on connection failures,
  as a probe (never to one that timed out and whose trial is not due); ``draining`` and ``disabled`` replicas finish what they have, and a replica
  removed from the registry keeps its client until its last request ends.
* An attempt is retried elsewhere only before its first chunk reached the consumer (or, a
  restartable one, by the consumer's new call): an engine failure, a first-token timeout, or its
  replica's breaker opening on unavailability while it waits (``mark_failed`` evicts it); a
  full engine queue (``EngineOverloaded``) is retried without counting against the replica.
* Indexes hold kvgate's own salted block hashes (the engines report in that space,
  ``engines/kv_events.py``), so a salted tenant's request never matches another tenant's
  blocks and the router never sees an engine's internal hash.
* Every gateway polling the same replicas builds the same indexes (each poller has its own
  cursor; reading events never consumes them), and the router breaks ties by a rendezvous
  hash, not by local state: gateways that see the same events choose the same replica for
  the same request when their loads agree.
* Load is what this gateway dispatched (queued prefill tokens, running requests, held
  blocks, and its recent prefill work, decayed); the in-flight part returns to zero when
  nothing is in flight. Alone, each gateway counts only its own dispatches, so gateways
  behind one balancer agree on a choice only while their load views stay within the balance
  band, and miss the blocks their peers' requests are computing. With routing sync
  (``peer_sync.py``, ``retention/routing/sync.py``) every gateway also applies its peers'
  dispatches, first tokens and completions, so load and pending blocks cover the whole
  fleet, late by the sync's delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from engines.contract import EngineRequest, cached_prompt_tokens
from engines.pool_stats import PoolStatsReport
from engines.kv_events import KvEventsReport
from retention.hashing import block_hashes
from retention.routing import (
    ApproximateIndex,
    Candidate,
    CapacityModel,
    Decision,
    Notice,
    PeerLoads,
    Router,
    RouteRequest,
    RoutingError,
    affinity_key,
    dispatch_notice,
    make_router,
)
from tenants.snapshots import PoolSnapshot
from server.gateway.context import REQUEST_ID
from server.gateway.replicas.abort import Aborts, Attempt, GatewayShuttingDown, ReplicaLost
from server.gateway.replicas.breaker import Breaker
from server.gateway.replicas.peer_sync import PeerSync
from server.gateway.replicas.engine_client import (
    EngineChunk, EngineClient, EngineError, EngineFailed, EngineOverloaded, EngineRejected, EngineTimeout,
    EngineUnavailable, timed_out,
)
from server.gateway.observe.metrics import ReplicaRow
from server.gateway.replicas.reports import report_as_pool_events, sum_reports
from server.gateway.replicas.routing_config import RoutingConfig
from server.gateway.replicas.stall import EngineRestart, EngineStalled, StallWatch

log = logging.getLogger("kvgate.gateway.routing")


@dataclass(slots=True)
class Replica:
    """One engine endpoint of a pool, as this gateway sees it."""

    id: int
    name: str
    endpoint: str
    state: str  # registry state: active | draining | disabled
    weight: int
    client: EngineClient
    breaker: Breaker = field(default_factory=Breaker)
    in_flight: int = 0
    cursor: int = 0  # KV events cursor (0 = ask for a snapshot)
    epoch: str = ""
    resets: int = 0  # times its index was dropped (breaker opened): a poll begun before is stale
    unknown_logged: set[str] = field(default_factory=set)  # stats fields / event kinds it sent that were logged
    events: bool | None = None  # None until the first successful poll
    stats: PoolStatsReport | None = None
    polling: asyncio.Task | None = None  # its stats poll in flight (one at a time), see Routing.poll
    waiting: set[Attempt] = field(default_factory=set)  # attempts here that have had no chunk yet

    @property
    def routable(self) -> bool:
        return self.state == "active" and self.breaker.closed


class PoolRoute:
    """The replicas and the router of one pool."""

    def __init__(self, pool: PoolSnapshot, config: RoutingConfig, clock: Callable[[], float],
                 peer_sync: PeerSync | None = None) -> None:
        self.name = pool.name
        self.config = config
        self._clock = clock
        self.pool = pool
        self.replicas: dict[int, Replica] = {}
        self.retiring: list[Replica] = []  # removed from the registry, requests still in flight
        self.router: Router = self._new_router(config.router)
        self.peer_sync = peer_sync
        # Peers' dispatches applied to this pool's router (routing sync on), else None.
        self.peers = None if peer_sync is None else PeerLoads(self.router, peer_sync.gateway, lease_s=peer_sync.lease_s)
        self.generation = 0  # bumped by use_router: a poll begun before the switch is discarded
        self.sync(pool)

    def _new_router(self, name: str) -> Router:
        return make_router(name, tokens_per_block=self.pool.tokens_per_block, cost=self.config.cost)

    def use_router(self, name: str) -> None:
        """Switch the routing policy (benchmarks); indexes are rebuilt from fresh snapshots."""
        self.router = self._new_router(name)
        if self.peers is not None:
            self.peers.reset(self.router)
        self.generation += 1
        for replica in self.replicas.values():
            replica.cursor = 0
            replica.events = None

    def sync(self, pool: PoolSnapshot) -> None:
        """Take the registry's replica set: add new ones, update states, retire removed ones."""
        self.pool = pool
        seen: set[int] = set()
        for entry in pool.replicas:
            seen.add(entry.id)
            replica = self.replicas.get(entry.id)
            if replica is not None and replica.endpoint != entry.endpoint:  # moved: a new engine
                self._retire(replica)
                replica = None
            if replica is None:
                replica = self.replicas[entry.id] = Replica(
                    entry.id, entry.name, entry.endpoint, entry.state, entry.weight,
                    EngineClient(entry.endpoint, pool.triton_model))
            replica.name, replica.state, replica.weight = entry.name, entry.state, entry.weight
        for gone in [r for rid, r in self.replicas.items() if rid not in seen]:
            self._retire(gone)

    def _retire(self, replica: Replica) -> None:
        self.replicas.pop(replica.id, None)
        self.router.forget_replica(replica.id)  # removed: its index and the load of its requests go
        replica.resets += 1  # a poll of it still in flight must not feed the id's next replica
        replica.state = "removed"
        self.retiring.append(replica)

    async def reap(self) -> None:
        """Close the clients of retired replicas that have nothing in flight."""
        done = [r for r in self.retiring if r.in_flight == 0]
        self.retiring = [r for r in self.retiring if r.in_flight > 0]
        for replica in done:
            if replica.polling is not None:
                replica.polling.cancel()
            with contextlib.suppress(Exception):
                await replica.client.close()

    def candidates(self, exclude: set[int]) -> list[Candidate]:
        """Active replicas with a closed breaker; when there are none, the active ones whose
        breaker is open on connection failures (a request is then the probe: failing at once
        would not be better, and a replica that came back, e.g. the only one after a restart,
        serves it). Never one that timed out and is not due for its trial: sending there
        would wait the whole first-token deadline again."""
        healthy = [Candidate(r.id, r.weight) for r in self.replicas.values() if r.routable and r.id not in exclude]
        if healthy:
            return healthy
        now = self._clock()
        return [Candidate(r.id, r.weight) for r in self.replicas.values()
                if r.state == "active" and r.id not in exclude and not r.breaker.avoid(now)]

    def can_route(self, exclude: set[int]) -> bool:
        """Whether a request excluding ``exclude`` has somewhere to go (a candidate or a trial)."""
        now = self._clock()
        return bool(self.candidates(exclude)) or any(
            r.state == "active" and r.id not in exclude and r.breaker.trial_due(now) for r in self.replicas.values())

    def take_trial(self, exclude: set[int]) -> Replica | None:
        """An active replica that timed out and is due for its one trial request, now taken
        (its breaker half-open: no other request goes there until the trial ends)."""
        now = self._clock()
        for replica in self.replicas.values():
            if replica.state == "active" and replica.id not in exclude and replica.breaker.start_trial(now):
                log.warning("replica %s/%s: trial request after a timeout", self.name, replica.name)
                return replica
        return None

    def _out_of_rotation(self, replica: Replica, why: str) -> None:
        log.warning("replica %s/%s (%s) out of rotation (%s)", self.name, replica.name, replica.endpoint, why)
        # Its cache may be gone (restart): its index starts over from a snapshot when it is back.
        # Its load stays: the requests still running there are released one by one by their
        # on_complete, and a replica back after a blip must not look idle while it runs them.
        self._reset_index(replica)

    def _reset_index(self, replica: Replica) -> None:
        """Drop the replica's index and ask its next poll for a snapshot; a poll already on its
        way (begun with the old cursor) is discarded when it answers (``resets``)."""
        replica.resets += 1
        replica.cursor, replica.events = 0, None
        if self.replicas.get(replica.id) is not replica:  # retired, or replaced under its id: not ours to drop
            return
        forget_index = getattr(self.router, "forget_index", None)  # routers without an index have none
        if forget_index is not None:
            forget_index(replica.id)

    def mark_failed(self, replica: Replica, *, evict: bool = True) -> None:
        """A connection failure (dispatch or stats poll), or an engine failure the replica answered
        a request with (``evict`` false). When it opens the breaker on an unreachable replica, the
        attempts still waiting there for their first chunk are evicted (cancelled, retried
        elsewhere by their RoutedEngine): left alone they would wait out their own deadline on a
        replica known to be down (a non-streamed answer's is the whole answer's, a minute or
        more). A replica that answered with a failure is up: its other requests run on."""
        if replica.breaker.fail(self._clock(), self.config.breaker_open_s, self.config.breaker_max_open_s):
            self._out_of_rotation(replica, "unavailable")
            for attempt in list(replica.waiting) if evict else ():
                attempt.evict()

    def mark_timed_out(self, replica: Replica, dispatched_at: float, why: str = "no first token in time") -> None:
        """An attempt dispatched at ``dispatched_at`` got no first token within the deadline (or,
        mid-answer, no next message since ``dispatched_at``)."""
        if replica.breaker.time_out(self._clock(), dispatched_at, self.config.breaker_open_s,
                                    self.config.breaker_max_open_s):
            self._out_of_rotation(replica, why)

    def mark_served(self, replica: Replica) -> None:
        """A request received its first token from ``replica``."""
        if replica.breaker.served(self._clock()):
            log.warning("replica %s/%s back in rotation (served a request)", self.name, replica.name)

    def start_poll(self, replica: Replica) -> asyncio.Task:
        """The replica's poll in flight, started now if none is (never two at once: the next
        round finds the slow one still running and leaves it be)."""
        task = replica.polling
        if task is None or task.done():
            task = replica.polling = asyncio.ensure_future(self.poll(replica))
            task.add_done_callback(lambda done: self._polled(replica, done))
        return task

    def _polled(self, replica: Replica, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # poll() catches its own: a bug
            exc = task.exception()
            log.warning("replica %s/%s: poll failed: %s: %s", self.name, replica.name, type(exc).__name__, exc)

    async def poll(self, replica: Replica) -> None:
        """One stats + events poll of ``replica``; doubles as the breaker's probe.

        An answer that cannot be read or applied (a newer engine's stats, a tier this gateway
        does not know) is a failed probe, logged, never an error of the poll loop. An answer
        to a poll begun before the replica's breaker opened is dropped: it was asked with the
        cursor of the index that has since been dropped, and the breaker opened after it left."""
        now = self._clock()
        if not replica.breaker.probe_due(now):
            return
        generation, resets = self.generation, replica.resets
        try:
            stats = await replica.client.stats(self.config.stats_timeout_s, events_since=replica.cursor)
        except EngineError as exc:
            if self._current(replica, resets):
                # Evict the attempts waiting there only when the replica hangs (its stats call got no
                # answer in time): their streams would wait out their own deadlines. A refused or
                # reset connection breaks those streams by itself, and an engine that answered (a
                # failure, a full queue) is up: its requests run on.
                self.mark_failed(replica, evict=timed_out(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one replica's unreadable answer must not stop the loop
            log.warning("replica %s/%s: stats answer not readable (%s: %s); counted as a failed probe",
                        self.name, replica.name, type(exc).__name__, exc)
            if self._current(replica, resets):
                self.mark_failed(replica, evict=False)  # it answered: up, its requests run on
            return
        if replica.resets != resets:
            return  # the breaker opened while this answer travelled: the next probe decides
        unknown = {*stats.unknown_fields, *(stats.kv_events.unknown_kinds if stats.kv_events is not None else ())}
        if unknown - replica.unknown_logged:  # a newer engine's fields or event kinds: said once per replica
            replica.unknown_logged |= unknown
            log.warning("replica %s/%s: its stats carry what this gateway does not know (%s): ignored; event "
                        "kinds are resynced from a snapshot", self.name, replica.name, ", ".join(sorted(unknown)))
        if generation == self.generation:
            try:
                self._feed(replica, stats.kv_events, asked_at=now)
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("replica %s/%s: KV events not applicable (%s: %s); counted as a failed probe",
                            self.name, replica.name, type(exc).__name__, exc)
                if self._current(replica, resets):
                    self._reset_index(replica)  # possibly half applied
                    self.mark_failed(replica, evict=False)  # it answered: up, its requests run on
                return
        if replica.breaker.probe_ok():  # not when it timed out: its stats answer while it hangs
            log.warning("replica %s/%s back in rotation", self.name, replica.name)
        replica.stats = stats

    def _current(self, replica: Replica, resets: int) -> bool:
        """Whether a poll begun at ``resets`` still speaks for ``replica``: polls now outlive a round,
        so a late failure of a replica since reset, retired or replaced under its id (a new endpoint)
        must not open a breaker or drop an index that is no longer the one it asked about."""
        return replica.resets == resets and self.replicas.get(replica.id) is replica

    @staticmethod
    def _continues(cursor: int, report: KvEventsReport) -> bool:
        """Whether an incremental report holds exactly the records from ``cursor`` on: sequence
        numbers ``cursor, cursor + 1, …, next_seq - 1`` (the ring's invariant, engines/kv_events.py)."""
        expected = cursor
        for record in report.events:
            if record.seq != expected:
                return False
            expected += 1
        return report.next_seq == expected

    def _feed(self, replica: Replica, report: KvEventsReport | None, *, asked_at: float | None = None) -> None:
        """Apply one poll's KV events (asked at ``asked_at``: every event the replica emitted
        before then is in this report or an earlier one; default: now)."""
        now = self._clock()
        if report is None or not report.supported:
            if replica.events is not False:  # approximate mode: index what we send there
                replica.events = False
                set_index = getattr(self.router, "set_index", None)
                if set_index is not None:
                    set_index(replica.id, ApproximateIndex(CapacityModel(
                        max(1, self.pool.primary_blocks), max(0, self.pool.secondary_blocks))))
            return
        if report.resync:
            # A record this gateway cannot apply (a newer engine's event kind): resync from a snapshot.
            replica.cursor = 0
            return
        if report.epoch != replica.epoch and report.snapshot is None:
            # The replica restarted since our cursor was taken: ask again from scratch.
            replica.cursor, replica.epoch = 0, report.epoch
            return
        if report.snapshot is None and not self._continues(replica.cursor, report):
            # A hole between our cursor and the records returned (the engine's log lost its
            # place): applying them would leave the index short for good. Ask for a snapshot.
            log.warning("replica %s/%s: KV events from seq %s to %s do not continue cursor %s; resyncing",
                        self.name, replica.name, report.events[0].seq if report.events else "-",
                        report.next_seq, replica.cursor)
            replica.cursor = 0
            return
        self.router.apply_events(replica.id, report_as_pool_events(report), now=now, as_of=asked_at)
        replica.events, replica.epoch, replica.cursor = True, report.epoch, report.next_seq

    def pool_stats(self) -> PoolStatsReport | None:
        """The pool's summed stats over the replicas in rotation (breaker closed).

        A replica out of rotation — down, or suspect (its stats answer but a request timed out
        there) — receives no new blocks, so neither its capacity nor the blocks tenants hold
        there count in quota arithmetic: both sides of ``held / (fraction × capacity)`` drop it
        together, and it counts again once a served request closes its breaker. (The engine
        counters on /metrics are not taken from this sum but per replica: :meth:`last_reports`.)"""
        return sum_reports(self.replica_reports().values())

    def replica_reports(self) -> dict[str, PoolStatsReport]:
        """Each replica in rotation's own latest report, by name (what :meth:`pool_stats` sums);
        capacity checks compare these, one by one, with the per-replica registration."""
        return {r.name: r.stats for r in self.replicas.values() if r.stats is not None and r.breaker.closed}

    def last_reports(self) -> dict[str, PoolStatsReport]:
        """Every registered replica's latest report, by name, whatever its breaker: what the engine
        counters on /metrics are exported from, one series per replica. A replica leaving rotation
        keeps its series (at its last report while its stats do not answer), so no series goes down
        but when that replica's engine restarts; a replica removed from the registry has none."""
        return {r.name: r.stats for r in self.replicas.values() if r.stats is not None}


class Routing:
    """Every pool's :class:`PoolRoute`; the gateway's single entry point for dispatch."""

    def __init__(self, config: RoutingConfig | None = None, *, metrics=None,
                 clock: Callable[[], float] = time.monotonic, peer_sync: PeerSync | None = None) -> None:
        self.config = config or RoutingConfig()
        self.metrics = metrics  # GatewayMetrics (replica-labelled series), optional in tests
        self._clock = clock
        self.pools: dict[str, PoolRoute] = {}
        self._forgotten: list[PoolRoute] = []  # routes of pools gone from the registry, closing their clients
        self.peer_sync = peer_sync
        self.aborts = Aborts()  # the attempts a forced shutdown ends (abort.py)
        if peer_sync is not None:
            peer_sync.attach(peers_of=self._peers_of, pools=lambda: list(self.pools), clock=clock)

    def _peers_of(self, pool: str) -> PeerLoads | None:
        route = self.pools.get(pool)
        return None if route is None else route.peers

    def route(self, pool: PoolSnapshot) -> PoolRoute:
        """The pool's route; the first request for a pool creates it from its snapshot."""
        route = self.pools.get(pool.name)
        if route is None:
            route = self.pools[pool.name] = PoolRoute(pool, self.config, self._clock, self.peer_sync)
        return route

    async def forget(self, name: str) -> None:
        """A pool the registry no longer lists (deleted, or renamed: the new name gets its own route):
        its route goes, so neither its replica series, nor its peer-sync heartbeats, nor its index
        outlive it; its replicas retire as a removed replica does (clients closed once nothing is
        in flight)."""
        route = self.pools.pop(name, None)
        if route is not None:
            for replica in list(route.replicas.values()):
                route._retire(replica)
            self._forgotten.append(route)
        await self._reap_forgotten()

    async def _reap_forgotten(self) -> None:
        for route in self._forgotten:
            await route.reap()
        self._forgotten = [route for route in self._forgotten if route.retiring]

    def use_router(self, name: str) -> None:
        make_router(name, tokens_per_block=1)  # validates the name
        self.config = replace(self.config, router=name)
        for route in self.pools.values():
            route.config = self.config
            route.use_router(name)

    async def poll(self, pool: PoolSnapshot) -> PoolStatsReport | None:
        """Sync the pool's replicas from ``pool``, poll each once (each its own task) and sum what
        has landed within ``poll_wait_s``. A poll still running then (a replica that accepts the
        call and never answers, up to ``stats_timeout_s``) keeps running and is applied when it
        lands (its ``resets`` / ``generation`` guards drop it if the index was reset meanwhile);
        the next round does not start another for that replica. So a hung replica holds up
        neither its pool's other replicas nor the pools polled after it."""
        route = self.route(pool)
        route.sync(pool)
        polls = [route.start_poll(r) for r in route.replicas.values()]
        if polls:
            await asyncio.wait(polls, timeout=self.config.poll_wait_s)
        await route.reap()
        if self._forgotten:
            await self._reap_forgotten()
        return route.pool_stats()

    def engine(self, pool: PoolSnapshot, *, only: Iterable[int] | None = None) -> RoutedEngine:
        """``only``: the replica ids the request may go to (None: any); see :class:`RoutedEngine`."""
        return RoutedEngine(self, self.route(pool), only=only)

    async def ready(self, pool: PoolSnapshot) -> bool:
        """Ready when at least one active replica answers."""
        route = self.route(pool)
        results = await asyncio.gather(*(r.client.ready() for r in route.replicas.values() if r.state == "active"))
        return any(results)

    def sync_rows(self) -> list[tuple[str, int, int]]:
        """Per pool: (name, peers heard within the lease, peers' requests in this gateway's load)."""
        return [(name, len(route.peers.peers()), route.peers.in_flight())
                for name, route in list(self.pools.items()) if route.peers is not None]

    def rows(self) -> list[ReplicaRow]:
        """Replica health and load for the metrics collector (read at scrape time)."""
        modes = {True: "precise", False: "approximate", None: "unknown"}
        return [ReplicaRow(name, r.name, r.state, r.breaker.closed, r.in_flight, modes[r.events])
                for name, route in list(self.pools.items()) for r in list(route.replicas.values())]

    async def close(self) -> None:
        if self.peer_sync is not None:
            await self.peer_sync.close()
        for route in [*self.pools.values(), *self._forgotten]:
            for replica in [*route.replicas.values(), *route.retiring]:
                if replica.polling is not None:
                    replica.polling.cancel()
                with contextlib.suppress(Exception):
                    await replica.client.close()
        self.pools.clear()
        self._forgotten.clear()


class RoutedEngine:
    """What the completion path streams from: one request, routed, retried, accounted.

    Same ``generate`` signature as :class:`EngineClient`, so ``completions.py`` does not
    know about replicas. Invariants: a retry happens only before anything was yielded (so
    the consumer never sees two replicas' tokens), or, for a *restartable* call (a consumer
    that keeps every chunk to itself until the end: a non-streamed answer the engine
    streams), by the consumer calling ``generate`` again after :class:`EngineRestart`; once
    the first chunk has been yielded and the answer went out, ``replica`` names the replica
    serving the rest and never changes; every attempt's engine call is cancelled when the
    attempt ends without the engine's final response, including when the engine goes
    silent mid-answer for the inter-token deadline (:class:`EngineStalled`).

    One instance serves one request: the replicas it tried and its retries count across the
    calls of a restarted request (``retries`` extra attempts in all). ``only`` confines it to
    those replica ids (its retries too): a request that is only of use where some blocks are
    cached, such as a conversation demote, never goes elsewhere.

    A replica that timed out gets its trial from the first attempt of a request (one that
    can still be retried if the trial times out too), or from a later one when nothing else
    is left; the trial's first chunk closes its breaker (``breaker.py``).
    """

    def __init__(self, routing: Routing, route: PoolRoute, *, only: Iterable[int] | None = None) -> None:
        self._routing = routing
        self._route = route
        self._only = None if only is None else frozenset(only)
        self.replica: str | None = None  # the replica of the last attempt (response header)
        self.affinity: int | None = None  # the request's affinity key (prompt_cache_key), see keyed()
        self._tried: set[int] = set()  # replicas that failed this request
        self._attempts = 0  # retries so far

    def _excluded(self) -> set[int]:
        """The replicas this request must not go to: those it failed on, and any outside ``only``."""
        if self._only is None:
            return self._tried
        return self._tried | {rid for rid in self._route.replicas if rid not in self._only}

    def keyed(self, tenant_id: int, cache_key: str | None) -> None:
        """Route by the client's ``prompt_cache_key``, salted with the tenant (``retention/routing/affinity.py``)."""
        self.affinity = None if cache_key is None else affinity_key(f"tenant:{tenant_id}", cache_key)

    async def generate(self, request: EngineRequest, *, request_id: str, timeout: float | None = None,
                       hashes: Sequence[int] | None = None, restartable: bool = False) -> AsyncIterator[EngineChunk]:
        """``hashes``: the prompt's block hashes when the caller already computed them (one
        hashing per request); they must be ``block_hashes(request.input_ids, pool
        tokens_per_block, salt=request.cache_salt)``. A list of the wrong length (another
        block size) is recomputed here.

        ``restartable``: nothing of the answer reaches the client before its end, so an attempt
        that fails after its first chunk may be run again elsewhere: it then raises
        :class:`EngineRestart` (instead of the failure) while a retry is left and a replica can
        take it. The retry re-runs the same request (same prompt, sampling and seed)."""
        route, clock = self._route, self._routing._clock
        tpb = route.pool.tokens_per_block
        if hashes is None or len(hashes) != len(request.input_ids) // tpb:
            hashes = block_hashes(request.input_ids, tpb, salt=request.cache_salt)
        routed = RouteRequest(request_id, tuple(hashes), len(request.input_ids), request.max_new_tokens,
                              affinity_key=self.affinity)
        config = self._routing.config
        wait = config.first_response_wait(request)
        stall = config.stall_wait() if request.streaming else None  # one message otherwise: ``wait`` covers it
        retries = config.retries
        sync = route.peer_sync
        aborts = self._routing.aborts
        tried = self._tried
        while True:
            excluded = self._excluded()
            candidates = route.candidates(excluded)
            trial = route.take_trial(excluded) if self._attempts < retries or not candidates else None
            if trial is not None:
                candidates = [Candidate(trial.id, trial.weight)]
            if not candidates:
                raise EngineUnavailable(f"no healthy active replica in pool '{route.name}'")
            router = route.router
            try:
                decision: Decision = router.route(routed, candidates, now=clock())
            except RoutingError as exc:
                raise EngineUnavailable(str(exc)) from exc
            replica = route.replicas[decision.replica]
            self.replica = replica.name
            dispatched_at = clock()
            router.on_dispatch(routed, decision, now=dispatched_at)
            if sync is not None:
                sync.publish(route.name, dispatch_notice(sync.gateway, routed, decision))
            replica.in_flight += 1
            produced = prefilled = False
            status, kv = "error", None
            watch: StallWatch | None = None
            attempt = aborts.begin()
            replica.waiting.add(attempt)  # until its first chunk: evicted if the replica goes down
            try:
                async with contextlib.aclosing(replica.client.generate(request, request_id=request_id,
                                                                       timeout=timeout)) as chunks:
                    deadline = None if wait is None else asyncio.get_running_loop().time() + wait
                    while True:
                        if attempt.aborted:  # aborted while the consumer had the chunk: stop before waiting
                            raise GatewayShuttingDown("the gateway is shutting down")
                        if attempt.evicted and not produced:
                            raise ReplicaLost(f"replica {route.name}/{replica.name} went out of rotation")
                        attempt.waiting = True
                        try:
                            if watch is not None:  # after the first chunk: the inter-token deadline
                                watch.waiting()
                                try:
                                    chunk = await anext(chunks)
                                except asyncio.CancelledError:
                                    if watch.expired():
                                        raise EngineStalled(f"replica {route.name}/{replica.name} sent nothing for "
                                                            f"{stall:g} s mid-answer", stall) from None
                                    raise
                                watch.got()
                            elif deadline is not None and not produced:
                                # Only the wait for the engine is bounded, never the consumer's
                                # time between chunks. Expiry cancels the await inside the
                                # client's generator, whose finally cancels the gRPC call: the
                                # engine drops the request (engines/reference/server.py,
                                # ModelStreamInfer; engines/triton/model.py, _cancel_abandoned).
                                async with asyncio.timeout_at(deadline):
                                    chunk = await anext(chunks)
                            else:
                                chunk = await anext(chunks)
                        except StopAsyncIteration:
                            break
                        except TimeoutError:
                            raise EngineTimeout(f"replica {route.name}/{replica.name} sent no token within "
                                                f"{wait:g} s") from None
                        except asyncio.CancelledError:
                            if attempt.caused():
                                if attempt.aborted:
                                    raise GatewayShuttingDown(f"the gateway is shutting down; the call to replica "
                                                              f"{route.name}/{replica.name} was cancelled") from None
                                raise ReplicaLost(f"replica {route.name}/{replica.name} went out of rotation "
                                                  "(unavailable) before its first token; call cancelled") from None
                            raise
                        finally:
                            attempt.waiting = False
                        kv = chunk.kv
                        if not produced:  # the replica answers: proof it serves (closes a breaker)
                            replica.waiting.discard(attempt)  # the consumer gets chunks: never evicted now
                            route.mark_served(replica)
                            if stall is not None and not chunk.final:
                                watch = StallWatch(stall)
                        # The consumer sees this chunk: no retry (unless restartable) and no
                        # first-token deadline from here on.
                        produced, deadline = True, None
                        if chunk.token_ids and not prefilled:
                            prefilled = True
                            router.on_prefill_done(request_id, now=clock())
                            if sync is not None:
                                sync.publish(route.name, Notice(sync.gateway, "first_token", request_id))
                        yield chunk
                status = "ok"
                return
            except EngineRejected:
                status = "rejected"
                raise
            except GatewayShuttingDown:  # not the replica's fault, and no replica is to take it over
                status = "cancelled"
                raise
            except EngineUnavailable as exc:
                if isinstance(exc, EngineStalled):
                    # Counted from when the silence began: a replica that served another
                    # request's first token since then is loaded, not hung (breaker.py).
                    route.mark_timed_out(replica, clock() - exc.waited, "silent mid-answer")
                elif isinstance(exc, EngineTimeout):
                    route.mark_timed_out(replica, dispatched_at)
                elif not isinstance(exc, (EngineOverloaded, ReplicaLost)):  # busy, or already counted
                    route.mark_failed(replica, evict=not isinstance(exc, EngineFailed))
                tried.add(replica.id)
                retry = (not produced or restartable) and self._attempts < retries and route.can_route(self._excluded())
                status = "retried" if retry else "error"
                if not retry:
                    raise
                self._attempts += 1
                what = ("stalled mid-answer" if isinstance(exc, EngineStalled)
                        else "timed out" if isinstance(exc, EngineTimeout)
                        else "overloaded" if isinstance(exc, EngineOverloaded)
                        else "out of rotation" if isinstance(exc, ReplicaLost) else "unavailable")
                # The client's request id (its answer's header) and the engine's: never the same, as
                # the engine id must be unique and a client may send its own request id.
                log.warning("request %s (engine request %s): replica %s/%s %s %s; retrying elsewhere",
                            REQUEST_ID.get() or "-", request_id, route.name, replica.name, what,
                            "after its first token (nothing sent to the client)" if produced
                            else "before its first token")
                if produced:
                    raise EngineRestart(f"replica {route.name}/{replica.name} {what}; run the request again") from exc
            except BaseException:  # consumer left (stop string, client gone) or cancelled
                status = "cancelled"
                raise
            finally:
                aborts.end(attempt)
                replica.waiting.discard(attempt)
                if watch is not None:
                    watch.close()
                if trial is not None:
                    trial.breaker.end_trial()  # no verdict (client gone, refused): the next request tries
                router.on_complete(request_id, now=clock())
                if sync is not None:
                    sync.publish(route.name, Notice(sync.gateway, "complete", request_id))
                replica.in_flight -= 1
                metrics = self._routing.metrics
                if metrics is not None:
                    cached = 0 if kv is None else cached_prompt_tokens(kv.reused_blocks, len(request.input_ids), tpb)
                    metrics.observe_replica(pool=route.name, replica=replica.name, status=status,
                                            prompt_tokens=len(request.input_ids), cached_tokens=cached)
