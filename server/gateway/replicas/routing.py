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
from engines.pool_stats import PoolStatsReport, TierStats
from engines.kv_events import MOVED, REMOVED, STORED, KvEventsReport
from retention.pool.events import CreatedEvent, KvEvent, RemovedEvent, StoredBlock, StoredEvent, UpdatedEvent
from retention.hashing import block_hashes
from retention.routing import (
    ApproximateIndex,
    Candidate,
    CapacityModel,
    CostModel,
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
from retention.types import Tier
from tenants.snapshots import PoolSnapshot
from server.gateway.context import REQUEST_ID
from server.gateway.replicas.breaker import Breaker
from server.gateway.replicas.peer_sync import PeerSync
from server.gateway.replicas.engine_client import (
    EngineChunk, EngineClient, EngineError, EngineRejected, EngineTimeout, EngineUnavailable,
)
from server.gateway.observe.metrics import ReplicaRow

log = logging.getLogger("kvgate.gateway.routing")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Gateway routing settings.

    ``router``: ``kv-aware`` (default) | ``round-robin`` | ``session`` | ``random``.
    ``cost``: weights of the kv-aware cost (``retention/routing/cost.py``). ``retries``:
    extra attempts on another replica for a request that failed before its first token.
    ``breaker_open_s`` / ``breaker_max_open_s``: a failed replica is probed again after
    ``open_s``, doubling per failed probe up to the maximum; a replica that timed out is not
    closed by its probe but gets one trial request per open period (``breaker.py``). ``stats_timeout_s``: a replica
    whose stats call takes longer has stopped answering.

    ``first_token_timeout_s`` (0 = none): how long one attempt may wait for its first token
    before it is cancelled, counted as the replica's failure and retried elsewhere (a replica
    that accepts requests but never answers, whose stats may still answer). When the engine
    does not stream (a non-streamed answer without stop strings comes in one message at the
    end) the first token cannot be seen, so that attempt's deadline is the whole answer's:
    ``first_token_timeout_s + max_new_tokens * answer_timeout_per_token_s``.

    ``inter_token_timeout_s`` (None = the first-token deadline, 0 = none): how long a streaming
    attempt may wait for its next engine message once it has had its first. On expiry the call
    is cancelled, the replica's breaker counts a timeout, and the attempt fails with
    :class:`EngineStalled`. Why the first-token deadline by default: a request the engine
    pauses mid-answer (preempted when its KV blocks run short) waits to be scheduled again as
    a new request waits for its first token, and recomputes its prefill when it is; a healthy
    gap between tokens is milliseconds, so the same bound only ends streams that stopped.
    """

    router: str = "kv-aware"
    cost: CostModel = field(default_factory=CostModel)
    retries: int = 1
    breaker_open_s: float = 0.5
    breaker_max_open_s: float = 10.0
    stats_timeout_s: float = 5.0
    first_token_timeout_s: float = 30.0
    answer_timeout_per_token_s: float = 0.5
    inter_token_timeout_s: float | None = None

    def first_response_wait(self, request: EngineRequest) -> float | None:
        """Seconds an attempt of ``request`` may wait for its first engine message (None: forever)."""
        if self.first_token_timeout_s <= 0:
            return None
        if request.streaming:
            return self.first_token_timeout_s
        return self.first_token_timeout_s + request.max_new_tokens * self.answer_timeout_per_token_s

    def stall_wait(self) -> float | None:
        """Seconds a streaming attempt may wait for its next engine message after its first (None: forever)."""
        limit = self.first_token_timeout_s if self.inter_token_timeout_s is None else self.inter_token_timeout_s
        return limit if limit > 0 else None


class EngineStalled(EngineTimeout):
    """The replica serving an answer sent nothing for the inter-token deadline after its first
    message; the router has cancelled the call (the engine freed the request)."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


class EngineRestart(EngineUnavailable):
    """A restartable attempt (:meth:`RoutedEngine.generate`) failed after its first message and
    another replica can take the request: call ``generate`` again on the same
    :class:`RoutedEngine` (the failed replica excluded, the retry counted), after dropping
    what the failed attempt produced. A consumer that does not restart treats it as what it
    is, an :class:`EngineUnavailable`."""


class _StallWatch:
    """The inter-token deadline of one attempt: cancels the task awaiting the attempt's next
    message once it has waited ``limit`` seconds (:meth:`expired` then tells the cancel apart).

    Why not ``asyncio.timeout`` around each message: that schedules and cancels a timer per
    token (~10 µs each, measured); this keeps one timer per ``limit`` seconds of streaming,
    re-armed lazily from the time the current wait began (a clock read per message). Only
    the wait for the engine counts, never the consumer's time between messages."""

    __slots__ = ("_loop", "_limit", "_task", "_since", "_handle", "_cancelling", "_fired")

    def __init__(self, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._task: asyncio.Task | None = None
        self._since: float | None = None  # when the current wait began; None between waits
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._fired = False

    def waiting(self) -> None:
        """The current task is about to await the next message."""
        self._since = now = self._loop.time()
        self._task = asyncio.current_task()
        if self._handle is None:
            self._handle = self._loop.call_at(now + self._limit, self._check)

    def got(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None or self._task is None:
            return  # not waiting now: the next wait re-arms
        due = since + self._limit
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        self._cancelling = self._task.cancelling()
        self._task.cancel()

    def expired(self) -> bool:
        """Called on ``CancelledError`` from the wait: True when this watch's cancel caused it
        (the cancel is then withdrawn); a cancel from elsewhere stays a cancel."""
        return self._fired and self._task is not None and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._since = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


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
    events: bool | None = None  # None until the first successful poll
    stats: PoolStatsReport | None = None

    @property
    def routable(self) -> bool:
        return self.state == "active" and self.breaker.closed


def report_as_pool_events(report: KvEventsReport) -> list[KvEvent]:
    """A replica's event report as ``retention.pool.events`` for the router's precise index.

    A snapshot becomes a *created* event (the index clears) followed by one *stored* event
    per cached block; records keep their sequence numbers as event ids so that the index's
    gap counter stays meaningful.
    """
    out: list[KvEvent] = []
    if report.snapshot is not None:
        base = report.next_seq - 1
        out.append(CreatedEvent(base - 1, (0, 0)))
        out.append(StoredEvent(base, None, tuple(StoredBlock(h, (), Tier(t), 0) for h, t in report.snapshot.items())))
    for record in report.events:
        if record.kind == STORED:
            out.append(StoredEvent(record.seq, None, tuple(StoredBlock(h, (), Tier(record.tier), 0) for h in record.hashes)))
        elif record.kind == REMOVED:
            out.append(RemovedEvent(record.seq, record.hashes))
        elif record.kind == MOVED:
            for h in record.hashes:
                # The old level is not carried; the index only reads the new one.
                out.append(UpdatedEvent(record.seq, h, (Tier(1 - record.tier), Tier(record.tier))))
    return out


def sum_reports(reports: Iterable[PoolStatsReport]) -> PoolStatsReport | None:
    """One pool-level report from its replicas': capacities, counters and tenant blocks add up.

    Quotas stay per pool: a tenant's share is measured against the pool's summed GPU
    blocks, with its blocks summed over replicas.
    """
    reports = list(reports)
    if not reports:
        return None
    first = reports[0]
    total = PoolStatsReport(first.tokens_per_block, TierStats(0, 0, 0), TierStats(0, 0, 0),
                            secondary_offload_min_priority=first.secondary_offload_min_priority)
    counters = ("reused_blocks", "missed_blocks", "alloc_total_blocks", "alloc_new_blocks", "offloaded_blocks",
                "onboarded_blocks", "evicted_blocks")
    for report in reports:
        for tier_name in ("primary", "secondary"):
            mine, theirs = getattr(total, tier_name), getattr(report, tier_name)
            mine.max_blocks += theirs.max_blocks
            mine.free_blocks += theirs.free_blocks
            mine.used_blocks += theirs.used_blocks
        for name in counters:
            setattr(total, name, getattr(total, name) + getattr(report, name))
        for tenant, counts in report.tenants.items():
            held = total.tenants.setdefault(tenant, [0, 0])
            held[0] += counts[0]
            held[1] += counts[1]
    lookups = total.reused_blocks + total.missed_blocks
    total.cache_hit_rate = total.reused_blocks / lookups if lookups else 0.0
    return total


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
        self.router.forget_replica(replica.id)
        replica.state = "removed"
        self.retiring.append(replica)

    async def reap(self) -> None:
        """Close the clients of retired replicas that have nothing in flight."""
        done = [r for r in self.retiring if r.in_flight == 0]
        self.retiring = [r for r in self.retiring if r.in_flight > 0]
        for replica in done:
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
        # Its cache may be gone (restart) and its load is unknown: start over when it is back.
        if replica.id in self.replicas:
            self.router.forget_replica(replica.id)
        replica.cursor, replica.events = 0, None

    def mark_failed(self, replica: Replica) -> None:
        """A connection failure (dispatch or stats poll)."""
        if replica.breaker.fail(self._clock(), self.config.breaker_open_s, self.config.breaker_max_open_s):
            self._out_of_rotation(replica, "unavailable")

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

    async def poll(self, replica: Replica) -> None:
        """One stats + events poll of ``replica``; doubles as the breaker's probe."""
        now = self._clock()
        if not replica.breaker.probe_due(now):
            return
        generation = self.generation
        try:
            stats = await replica.client.stats(self.config.stats_timeout_s, events_since=replica.cursor)
        except EngineError:
            self.mark_failed(replica)
            return
        if replica.breaker.probe_ok():  # not when it timed out: its stats answer while it hangs
            log.warning("replica %s/%s back in rotation", self.name, replica.name)
        replica.stats = stats
        if generation == self.generation:
            self._feed(replica, stats.kv_events)

    def _feed(self, replica: Replica, report: KvEventsReport | None) -> None:
        now = self._clock()
        if report is None or not report.supported:
            if replica.events is not False:  # approximate mode: index what we send there
                replica.events = False
                set_index = getattr(self.router, "set_index", None)
                if set_index is not None:
                    set_index(replica.id, ApproximateIndex(CapacityModel(
                        max(1, self.pool.primary_blocks), max(0, self.pool.secondary_blocks))))
            return
        if report.epoch != replica.epoch and report.snapshot is None:
            # The replica restarted since our cursor was taken: ask again from scratch.
            replica.cursor, replica.epoch = 0, report.epoch
            return
        replica.events, replica.epoch, replica.cursor = True, report.epoch, report.next_seq
        self.router.apply_events(replica.id, report_as_pool_events(report), now=now)

    def pool_stats(self) -> PoolStatsReport | None:
        """The pool's summed stats over the replicas in rotation (breaker closed).

        A replica out of rotation — down, or suspect (its stats answer but a request timed out
        there) — receives no new blocks, so neither its capacity nor the blocks tenants hold
        there count in quota arithmetic: both sides of ``held / (fraction × capacity)`` drop it
        together, and it counts again once a served request closes its breaker."""
        return sum_reports(self.replica_reports().values())

    def replica_reports(self) -> dict[str, PoolStatsReport]:
        """Each replica in rotation's own latest report, by name (what :meth:`pool_stats` sums);
        capacity checks compare these, one by one, with the per-replica registration."""
        return {r.name: r.stats for r in self.replicas.values() if r.stats is not None and r.breaker.closed}


class Routing:
    """Every pool's :class:`PoolRoute`; the gateway's single entry point for dispatch."""

    def __init__(self, config: RoutingConfig | None = None, *, metrics=None,
                 clock: Callable[[], float] = time.monotonic, peer_sync: PeerSync | None = None) -> None:
        self.config = config or RoutingConfig()
        self.metrics = metrics  # GatewayMetrics (replica-labelled series), optional in tests
        self._clock = clock
        self.pools: dict[str, PoolRoute] = {}
        self.peer_sync = peer_sync
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

    def use_router(self, name: str) -> None:
        make_router(name, tokens_per_block=1)  # validates the name
        self.config = replace(self.config, router=name)
        for route in self.pools.values():
            route.config = self.config
            route.use_router(name)

    async def poll(self, pool: PoolSnapshot) -> PoolStatsReport | None:
        """Sync the pool's replicas from ``pool`` and poll each once (concurrently)."""
        route = self.route(pool)
        route.sync(pool)
        replicas = list(route.replicas.values())
        await asyncio.gather(*(route.poll(r) for r in replicas))
        await route.reap()
        return route.pool_stats()

    def engine(self, pool: PoolSnapshot) -> RoutedEngine:
        return RoutedEngine(self, self.route(pool))

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
        for route in self.pools.values():
            for replica in [*route.replicas.values(), *route.retiring]:
                with contextlib.suppress(Exception):
                    await replica.client.close()
        self.pools.clear()


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
    calls of a restarted request (``retries`` extra attempts in all).

    A replica that timed out gets its trial from the first attempt of a request (one that
    can still be retried if the trial times out too), or from a later one when nothing else
    is left; the trial's first chunk closes its breaker (``breaker.py``).
    """

    def __init__(self, routing: Routing, route: PoolRoute) -> None:
        self._routing = routing
        self._route = route
        self.replica: str | None = None  # the replica of the last attempt (response header)
        self.affinity: int | None = None  # the request's affinity key (prompt_cache_key), see keyed()
        self._tried: set[int] = set()  # replicas that failed this request
        self._attempts = 0  # retries so far

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
        tried = self._tried
        while True:
            candidates = route.candidates(tried)
            trial = route.take_trial(tried) if self._attempts < retries or not candidates else None
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
            watch: _StallWatch | None = None
            try:
                async with contextlib.aclosing(replica.client.generate(request, request_id=request_id,
                                                                       timeout=timeout)) as chunks:
                    deadline = None if wait is None else asyncio.get_running_loop().time() + wait
                    while True:
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
                        kv = chunk.kv
                        if not produced:  # the replica answers: proof it serves (closes a breaker)
                            route.mark_served(replica)
                            if stall is not None and not chunk.final:
                                watch = _StallWatch(stall)
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
            except EngineUnavailable as exc:
                if isinstance(exc, EngineStalled):
                    # Counted from when the silence began: a replica that served another
                    # request's first token since then is loaded, not hung (breaker.py).
                    route.mark_timed_out(replica, clock() - exc.waited, "silent mid-answer")
                elif isinstance(exc, EngineTimeout):
                    route.mark_timed_out(replica, dispatched_at)
                else:
                    route.mark_failed(replica)
                tried.add(replica.id)
                retry = (not produced or restartable) and self._attempts < retries and route.can_route(tried)
                status = "retried" if retry else "error"
                if not retry:
                    raise
                self._attempts += 1
                what = ("stalled mid-answer" if isinstance(exc, EngineStalled)
                        else "timed out" if isinstance(exc, EngineTimeout) else "unavailable")
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
