"""Trace replay over N replica pools behind a router (``kvgate simulate --replicas N``).

Each replica is its own :class:`BlockPool` (same shape, same retention policy); a router
from ``retention/routing/`` — the code the gateway runs — picks the replica of every
request, keyed as the gateway keys it (the line's ``prompt_cache_key``, else a stored
conversation's root response, ``ClusterConfig.conversations``). The ``kv-aware`` router's indexes are fed the way the gateway feeds them: *precise*
from each pool's own KV events (drained after every allocate / release, so the index sees
offloads, onboards and evictions as they happen), or *approximate* from its own decisions.

``--hold none``: every request is allocated and released at its arrival (no load; the
router still sees its indexes). ``--hold tokens``: per replica the single-pool model of
``retention/simulation/simulator.py`` — FIFO admission, blocks held for ``(prompt − cached) /
prefill_tps + output / decode_tps`` — with one event clock across replicas::

    arrival ─► route ─► on_dispatch ─► replica's FIFO ─► allocate ─► prefill done: the
        prompt's blocks stored (reusable from now, as TensorRT-LLM's storeContextBlocks), events
        ─► apply_events, on_prefill_done ─► finish: release, events ─► apply_events, on_complete

Replicas compute independently (a replica's service time does not depend on its
concurrency); load matters through KV capacity (held blocks push cached ones out, and a
full replica makes requests wait) — the contention ``--hold tokens`` models.

Reported: token hit rate per tier (totals and per tenant, as :class:`PolicyResult`), per
replica requests / prompt tokens / computed prefill tokens, and the load imbalance
``max / mean`` of computed prefill tokens per replica. The ceiling (one pool with N× the
capacity) is ``retention.simulation.simulator.simulate`` at N× the blocks.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from retention.pool import BlockPool, PoolConfig
from retention.routing import (
    BandTuning,
    Candidate,
    CapacityModel,
    ConversationRoots,
    CostModel,
    Notice,
    PeerLoads,
    Router,
    RouteRequest,
    affinity_key,
    approximate_indexes,
    dispatch_notice,
    make_router,
)
from retention.simulation.sim_policies import SimPolicy
from retention.simulation.simulator import PolicyResult, Prompts, SimConfig, TenantResult, admit_request, record_outcome
from retention.trace import TraceRequest

IndexMode = Literal["precise", "approximate"]
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The replica set and its router.

    ``index``: how kv-aware learns what a replica holds (``precise`` = pool events,
    ``approximate`` = its own decisions in a two-tier LRU of the pool's size, optionally
    aged by ``ttl_s``). ``seed`` seeds the router's random source (``random``, softmax).
    ``affinity``: route by the lines' ``prompt_cache_key`` (salted with the line's tenant,
    as the gateway salts it with the tenant's id); off, the key is ignored. ``conversations``:
    a stored Responses conversation without a client key is routed by its root response's id
    (``previous_response_id`` chains, ``retention.routing.ConversationRoots``), as the gateway
    routes it (``server/gateway/api/responses_convert.py``, ``conversation_key``); off, only
    the client's key counts. ``tuning``: the self-tuning band's knobs (router ``kv-adaptive`` only).
    ``gateways``: gateway replicas in front of the pool, each with its own router; request ``i`` goes
    through gateway ``i mod gateways`` (a round-robin load balancer, so a conversation's turns may cross
    gateways), every gateway receives every replica's events (as gateways polling every replica do),
    and each counts only its own dispatches: its load view is its share of the traffic. ``sync``:
    the gateways publish their routing hooks to one another (``retention/routing/sync.py``, as
    ``server/gateway/replicas/peer_sync.py`` does over Redis) and a peer applies each notice
    ``sync_delay_s`` after it was sent, so each gateway's load and pending blocks cover every
    gateway's dispatches, late by that delay.
    """

    replicas: int
    router: str = "kv-aware"
    cost: CostModel = CostModel()
    index: IndexMode = "precise"
    ttl_s: float | None = None
    seed: int = 0
    affinity: bool = True
    conversations: bool = True
    tuning: BandTuning = BandTuning()
    gateways: int = 1
    sync: bool = False
    sync_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.gateways < 1:
            raise ValueError("gateways must be >= 1")
        if not (math.isfinite(self.sync_delay_s) and self.sync_delay_s >= 0):
            raise ValueError("sync_delay_s must be a number of seconds >= 0")
        if self.sync_delay_s and not self.sync:
            raise ValueError("sync_delay_s applies to sync=True only")
        if self.index not in ("precise", "approximate"):
            raise ValueError(f"index must be 'precise' or 'approximate', got {self.index!r}")


@dataclass(slots=True)
class ReplicaResult(TenantResult):
    """One replica's counts: a tenant's (requests, hits, ``hit_rate``) plus its load."""

    replica: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (not served from cache)
    delayed_requests: int = 0


@dataclass(slots=True)
class ClusterResult:
    router: str
    index: str
    total: PolicyResult
    replicas: list[ReplicaResult] = field(default_factory=list)
    predicted_hit_blocks: int = 0  # kv-aware: held blocks its index saw on the chosen replica

    @staticmethod
    def _imbalance(values: Sequence[int]) -> float:
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 1.0

    @property
    def load_imbalance(self) -> float:
        """max / mean computed prefill tokens per replica (1.0 = perfectly even)."""
        return self._imbalance([r.prefill_tokens for r in self.replicas])

    @property
    def request_imbalance(self) -> float:
        """max / mean requests per replica."""
        return self._imbalance([r.requests for r in self.replicas])

    def to_dict(self) -> dict:
        return {
            "router": self.router,
            "index": self.index,
            "load_imbalance": self.load_imbalance,
            "predicted_hit_blocks": self.predicted_hit_blocks,
            "request_imbalance": self.request_imbalance,
            "total": self.total.to_dict(),
            "replicas": [{**asdict(r), "hit_rate": r.hit_rate} for r in self.replicas],
        }


def _build_router(cluster: ClusterConfig, config: SimConfig, primary: int, secondary: int, gateway: int = 0) -> Router:
    """Gateway ``gateway``'s router; its random source is seeded with ``cluster.seed + gateway``."""
    factory = None
    if cluster.index == "approximate":
        factory = approximate_indexes(CapacityModel(primary, secondary, cluster.ttl_s))
    return make_router(
        cluster.router, tokens_per_block=config.tokens_per_block, cost=cluster.cost, index_factory=factory,
        rng=random.Random(cluster.seed + gateway), tuning=cluster.tuning,
    )


def simulate_cluster(
    requests: Sequence[TraceRequest],
    policy_factory: Callable[[], SimPolicy],
    *,
    cluster: ClusterConfig,
    primary_blocks: int,
    secondary_blocks: int,
    config: SimConfig = SimConfig(),
    hashes: Sequence[list[int]] | None = None,
    progress: Progress | None = None,
    prompts: Prompts | None = None,
) -> ClusterResult:
    """Replay ``requests`` over ``cluster.replicas`` fresh pools (each ``primary_blocks`` GPU).

    ``hashes``: what the routers and policies see (default: the requests' block hashes);
    ``prompts``: the requests' prompts, shared by replays of the same trace (default: made here).
    """
    policies = [policy_factory() for _ in range(cluster.replicas)]
    name = policies[0].name
    secondary = secondary_blocks if policies[0].uses_host else 0
    events_on = cluster.router in ("kv-aware", "kv-adaptive") and cluster.index == "precise"
    pools = [
        BlockPool(
            PoolConfig(
                primary_blocks=primary_blocks, secondary_blocks=secondary, tokens_per_block=config.tokens_per_block,
                secondary_offload_min_priority=p.offload_min_priority, event_buffer_max_size=None if events_on else 0,
            )
        )
        for p in policies
    ]
    routers = [_build_router(cluster, config, primary_blocks, secondary, g) for g in range(cluster.gateways)]
    owner: dict[int, int] = {}  # request index -> the gateway that dispatched it (its hooks go there)
    peers = [PeerLoads(router, str(g)) for g, router in enumerate(routers)] if cluster.sync else []
    notices: list[tuple[float, int, int, Notice]] = []  # (due, seq, gateway, notice): in flight between gateways
    sent = 0
    candidates = [Candidate(i) for i in range(cluster.replicas)]
    if prompts is None:
        prompts = Prompts(requests, config)
    if hashes is None:
        hashes = prompts.hashes(requests)
    total = PolicyResult(name, primary_blocks, secondary)
    per_replica = [ReplicaResult(replica=i) for i in range(cluster.replicas)]
    bpt = config.tokens_per_block
    predicted = 0
    roots = ConversationRoots()  # stored responses' roots, per tenant, as the gateway's store knows them

    def feed(replica: int, now: float) -> None:
        if events_on:
            events = pools[replica].take_events()
            for router in routers:
                router.apply_events(replica, events, now=now)

    def publish(notice: Notice, now: float) -> None:
        nonlocal sent
        for g, peer in enumerate(peers):
            if str(g) == notice.gateway:
                continue
            if cluster.sync_delay_s == 0:
                peer.apply(notice, now=now)
            else:
                heapq.heappush(notices, (now + cluster.sync_delay_s, sent, g, notice))
                sent += 1

    def deliver(until: float) -> None:
        while notices and notices[0][0] <= until:
            due, _, g, notice = heapq.heappop(notices)
            peers[g].apply(notice, now=due)

    def prefill_done(index: int, now: float) -> None:
        routers[owner[index]].on_prefill_done(index, now=now)
        if peers:
            publish(Notice(str(owner[index]), "first_token", str(index)), now)

    def complete(index: int, now: float) -> None:
        gateway = owner.pop(index)
        routers[gateway].on_complete(index, now=now)
        if peers:
            publish(Notice(str(gateway), "complete", str(index)), now)

    def account(replica: int, request: TraceRequest, reused: int, onboarded: int, rejected: bool) -> None:
        tenant = total.tenants.setdefault(request.tenant or "-", TenantResult())
        rep = per_replica[replica]
        for target in (total, tenant, rep):
            record_outcome(target, request.input_length, reused, onboarded, rejected, bpt)
        rep.prefill_tokens += request.input_length - (0 if rejected else reused * bpt)

    def route(request: TraceRequest, now: float) -> int:
        nonlocal predicted
        h = hashes[request.index]
        key = request.hints.cache_key if cluster.affinity and request.hints is not None else None
        if cluster.conversations:  # the gateway's rule: the client's key wins, else the conversation's root
            key = roots.key(request.tenant, cache_key=key, response_id=request.response_id,
                            previous_response_id=request.previous_response_id, store=request.store)
        rr = RouteRequest(request.index, tuple(h), request.input_length, request.output_length,
                          affinity_key=None if key is None else affinity_key(request.tenant, key))
        gateway = owner[request.index] = request.index % len(routers)
        router = routers[gateway]
        deliver(now)
        decision = router.route(rr, candidates, now=now)
        router.on_dispatch(rr, decision, now=now)
        if peers:
            publish(dispatch_notice(str(gateway), rr, decision), now)
        predicted += decision.match.blocks
        return decision.replica

    def try_admit(replica: int, request: TraceRequest, now: float, reserve: int):
        tokens, alloc = admit_request(pools[replica], policies[replica], request, hashes[request.index], config,
                                      now, reserve, prompts)
        if alloc is not None:
            feed(replica, now)
        return tokens, alloc

    def reject(replica: int, request: TraceRequest, now: float) -> None:
        policies[replica].observe(request, hashes[request.index], None, now=now, pool=pools[replica])
        account(replica, request, 0, 0, True)
        complete(request.index, now)

    if config.hold == "none":
        for request in requests:
            now = request.timestamp_ms / 1000.0
            replica = route(request, now)
            tokens, alloc = try_admit(replica, request, now, 0)
            if alloc is None:
                reject(replica, request, now)
            else:
                account(replica, request, alloc.reused_blocks, alloc.onboarded_blocks, False)
                prefill_done(request.index, now)
                pools[replica].release(request.index, tokens, now=now, num_computed_tokens=len(tokens))
                feed(replica, now)
                complete(request.index, now)
            if progress is not None:
                progress(1)
        _finish_totals(total, pools)
        return ClusterResult(cluster.router, cluster.index, total, per_replica, predicted)

    # --hold tokens: one clock, events (time, seq, kind, replica, request index, tokens)
    clock: list[tuple[float, int, int, int, int, object]] = []
    seq = 0
    waiting: list[deque[TraceRequest]] = [deque() for _ in range(cluster.replicas)]
    running = [0] * cluster.replicas
    PREFILL_DONE, FINISH = 0, 1

    def admit_waiting(replica: int, now: float) -> None:
        nonlocal seq
        queue = waiting[replica]
        while queue:
            request = queue[0]
            tokens, alloc = try_admit(replica, request, now, request.output_length)
            if alloc is None:
                if running[replica]:
                    return  # head-of-line request waits for capacity on its replica
                queue.popleft()
                reject(replica, request, now)
                if progress is not None:
                    progress(1)
                continue
            queue.popleft()
            if now > request.timestamp_ms / 1000.0:
                total.delayed_requests += 1
                total.total_wait_s += now - request.timestamp_ms / 1000.0
                per_replica[replica].delayed_requests += 1
            account(replica, request, alloc.reused_blocks, alloc.onboarded_blocks, False)
            prefill = (request.input_length - alloc.num_cached_tokens) / config.prefill_tokens_per_s
            decode = request.output_length / config.decode_tokens_per_s
            running[replica] += 1
            heapq.heappush(clock, (now + prefill, seq, PREFILL_DONE, replica, request.index, tokens))
            heapq.heappush(clock, (now + prefill + decode, seq + 1, FINISH, replica, request.index, tokens))
            seq += 2
            if progress is not None:
                progress(1)

    def run_until(limit: float | None) -> None:
        while clock and (limit is None or clock[0][0] <= limit):
            deliver(clock[0][0])
            at, _, kind, replica, index, tokens = heapq.heappop(clock)
            if kind == PREFILL_DONE:  # its prompt's blocks are reusable now (storeContextBlocks), events sent
                pools[replica].store(index, tokens, num_computed_tokens=len(tokens) - 1)  # type: ignore[arg-type]
                feed(replica, at)
                prefill_done(index, at)
                continue
            pools[replica].release(index, tokens, now=at, num_computed_tokens=len(tokens))  # type: ignore[arg-type]
            feed(replica, at)
            complete(index, at)
            running[replica] -= 1
            admit_waiting(replica, at)

    for request in requests:
        now = request.timestamp_ms / 1000.0
        run_until(now)
        replica = route(request, now)
        waiting[replica].append(request)
        admit_waiting(replica, now)
    run_until(None)
    _finish_totals(total, pools)
    return ClusterResult(cluster.router, cluster.index, total, per_replica, predicted)


def _finish_totals(total: PolicyResult, pools: Sequence[BlockPool]) -> None:
    for pool in pools:
        stats = pool.stats()
        total.offloaded_blocks += stats.offloaded_blocks
        total.onboarded_blocks += stats.onboarded_blocks
        total.evicted_primary_blocks += stats.evicted_primary_blocks
        total.evicted_secondary_blocks += stats.evicted_secondary_blocks


@dataclass(slots=True)
class ClusterReport:
    """Every router over the same replicas, and the ceiling: one pool with N× the capacity."""

    replicas: int
    primary_blocks: int  # per replica
    secondary_blocks: int  # per replica
    ceiling: PolicyResult
    results: dict[str, ClusterResult]

    def share_of_ceiling(self, router: str) -> float:
        top = self.ceiling.hit_rate
        return self.results[router].total.hit_rate / top if top else 0.0

    def to_dict(self) -> dict:
        return {
            "replicas": self.replicas,
            "primary_blocks_per_replica": self.primary_blocks,
            "secondary_blocks_per_replica": self.secondary_blocks,
            "ceiling": self.ceiling.to_dict(),
            "routers": {
                name: {**r.to_dict(), "share_of_ceiling": self.share_of_ceiling(name)} for name, r in self.results.items()
            },
        }


def compare_routers(
    requests: Sequence[TraceRequest],
    policy_factory: Callable[[], SimPolicy],
    routers: Sequence[ClusterConfig],
    *,
    primary_blocks: int,
    secondary_blocks: int,
    config: SimConfig = SimConfig(),
    labels: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> ClusterReport:
    """Each cluster configuration (same replica count), plus the single-pool ceiling.

    ``labels`` name the results (default: the router names, which must then be distinct).
    """
    from retention.simulation.simulator import simulate  # the single-pool replay, for the ceiling

    if not routers:
        raise ValueError("at least one router configuration is needed")
    count = routers[0].replicas
    if any(r.replicas != count for r in routers):
        raise ValueError("every configuration must have the same number of replicas")
    names = list(labels) if labels is not None else [r.router for r in routers]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate result labels: {names}")
    prompts = Prompts(requests, config)  # one trace: every replay below shares its prompts
    hashes = prompts.hashes(requests)
    ceiling = simulate(
        requests, policy_factory(), primary_blocks=count * primary_blocks, secondary_blocks=count * secondary_blocks,
        config=config, hashes=hashes, progress=progress, prompts=prompts,
    )
    results = {
        name: simulate_cluster(
            requests, policy_factory, cluster=cluster, primary_blocks=primary_blocks,
            secondary_blocks=secondary_blocks, config=config, hashes=hashes, progress=progress, prompts=prompts,
        )
        for name, cluster in zip(names, routers, strict=True)
    }
    secondary = secondary_blocks if ceiling.secondary_blocks else 0
    return ClusterReport(count, primary_blocks, secondary, ceiling, results)
