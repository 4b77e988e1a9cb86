"""Polls every pool's engine stats; derives per-tenant KV quota state with hysteresis.

Each poll goes through :class:`server.gateway.replicas.routing.Routing`, which polls every replica
of the pool (stats + KV events for the router, and the breaker's probe; each replica on its own
task, so one that never answers delays only itself, and the pools concurrently) and sums their
reports: quotas stay per pool, a tenant's blocks summed over the pool's replicas. The
registry-vs-engine capacity check is per replica (the registration's block counts are per
replica): each replica's own report against it, never the sum. The engines' cumulative block
counters are exported per replica too, from every replica's last report whether it is in
rotation or not: a sum over the replicas in rotation would go down whenever one left.

The state machine is ``retention.policy.quota.QuotaTracker`` (the simulator uses the same one):
a tenant is *over quota* on a pool when the primary (GPU) blocks it holds exceed
``kv_quota_fraction × primary_blocks``, and stays demoted until it is back at or under
90 % of that. Trackers are keyed by the engine's tenant id (``str(tenant.id)``). The
state is a function of the engines' per-tenant block counts, so after a gateway restart
the first poll rebuilds it (``QuotaTracker.rebuild`` semantics).

The registry listing is bounded (``listing_timeout``): a registry that stops answering
without an error must not stop the replicas' polling (their breakers, KV indexes and the
quota state all come from it), so past the timeout the poll goes on with the last listing.
The listing's worker thread cannot be interrupted; while it is stuck no other one starts
(the next polls wait for that one, within their own timeout), so a long outage strands one
thread, not one per poll.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from engines.pool_stats import PoolStatsReport
from retention.policy.planner import QuotaState
from retention.policy.quota import QuotaTracker
from tenants.snapshots import PoolSnapshot
from server.gateway.observe.capacity_check import CapacityCheck, capacity_mismatch
from server.gateway.observe.miss_ratio import MissRatioCurves
from server.gateway.replicas.engines import EngineDirectory
from server.gateway.observe.metrics import PoolSnapshot
from server.gateway.replicas.routing import Routing

log = logging.getLogger("kvgate.gateway")

@dataclass(frozen=True, slots=True)
class TenantQuota:
    tenant_id: int
    slug: str
    kv_quota_fraction: float


LISTING_TIMEOUT_S = 2.0  # the registry listing of one poll; a healthy one takes milliseconds


def _retrieve(flight: asyncio.Future) -> None:
    """Mark a listing's error as seen (a poll that gave up on it no longer awaits it)."""
    if not flight.cancelled():
        flight.exception()


class PoolMonitor:
    def __init__(self, directory: EngineDirectory,
                 pools_and_tenants: Callable[[], list[tuple[PoolSnapshot, list[TenantQuota]]]], *,
                 routing: Routing | None = None, hysteresis: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, listing_timeout: float = LISTING_TIMEOUT_S,
                 curves: MissRatioCurves | None = None) -> None:
        self._directory = directory
        self._curves = curves  # the miss-ratio curves follow the listing too
        self._routing = routing if routing is not None else Routing()
        self._pools_and_tenants = pools_and_tenants  # sync (reads the registry); run in a thread
        self._listing_timeout = listing_timeout
        self._listing: asyncio.Future | None = None  # the registry listing in progress
        self._hysteresis = hysteresis
        self._clock = clock
        self._stats: dict[str, PoolStatsReport] = {}
        self._quotas: dict[str, dict[str, TenantQuota]] = {}
        self._trackers: dict[str, QuotaTracker] = {}
        self.last_refresh: dict[str, float] = {}
        self.engine_up: dict[str, bool] = {}  # pool -> did its last stats call answer
        self._capacity: dict[str, CapacityCheck] = {}
        self._replicas: dict[str, dict[str, PoolStatsReport]] = {}  # pool -> every replica's last report

    def quota_state(self, pool: str, tenant_id: int) -> QuotaState:
        tracker = self._trackers.get(pool)
        return QuotaState() if tracker is None else tracker.state(str(tenant_id))

    def tenant_slugs(self, pool: str) -> dict[str, str]:
        """Engine tenant id -> registry slug for the tenants the last listing had on ``pool``."""
        return {tid: q.slug for tid, q in self._quotas.get(pool, {}).items()}

    def stats(self, pool: str) -> PoolStatsReport | None:
        return self._stats.get(pool)

    def capacity(self, pool: str) -> CapacityCheck | None:
        """Registered vs engine-reported capacity from the latest poll (None before the first)."""
        return self._capacity.get(pool)

    def apply(self, pool: PoolSnapshot, stats: PoolStatsReport, tenants: Iterable[TenantQuota],
              replicas: Mapping[str, PoolStatsReport] | None = None) -> None:
        """Fold one stats report into the quota state (pure apart from self).

        ``stats``: the pool's report summed over its replicas in rotation (quotas are per
        pool); ``replicas``: each of those replicas' own report, which the capacity check
        compares with the per-replica registration. None: ``stats`` is the report of the
        pool's only replica."""
        self._stats[pool.name] = stats
        quotas = {str(t.tenant_id): t for t in tenants}
        self._quotas[pool.name] = quotas
        if replicas is None:
            replicas = {pool.replicas[0].name if pool.replicas else pool.name: stats}
        check = capacity_mismatch(pool, replicas)
        if check.mismatch and self._capacity.get(pool.name) != check:  # once per new disagreement, not per poll
            log.warning(check.message())
        self._capacity[pool.name] = check
        capacity = max(1, check.effective_primary)  # the engine's blocks, not the registry's
        fractions = {engine_id: q.kv_quota_fraction for engine_id, q in quotas.items()}
        previous = self._trackers.get(pool.name)
        # Quotas and capacity come from the registry/engine on every poll; the demoted set
        # carries over for tenants that still have a quota.
        tracker = QuotaTracker(capacity, fractions, self._hysteresis,
                               demoted=set() if previous is None else previous.demoted & fractions.keys())
        tracker.update({tid: (counts[0], counts[1]) for tid, counts in stats.tenants.items()})
        self._trackers[pool.name] = tracker
        self.last_refresh[pool.name] = self._clock()

    async def _list(self) -> list[tuple[PoolSnapshot, list[TenantQuota]]]:
        """The registry's pools and tenants; ``TimeoutError`` past ``listing_timeout``."""
        if self._listing is None or self._listing.done():
            self._listing = asyncio.ensure_future(anyio.to_thread.run_sync(self._pools_and_tenants))
            self._listing.add_done_callback(_retrieve)
        with anyio.fail_after(self._listing_timeout):
            return await asyncio.shield(self._listing)

    async def refresh(self) -> None:
        """Poll every registered pool once, the pools concurrently (a slow pool never delays the
        others; within a pool, ``Routing.poll`` waits for no slow replica either). Registry or
        engine failures keep the last state; an unexpected error in one pool's poll is logged and
        keeps that pool's last state, never stops the other pools' polls."""
        try:
            listing = await self._list()
        except Exception:  # registry down or silent: poll the pools we know, with their last tenants
            listing = [(pool, list(self._quotas.get(pool.name, {}).values())) for pool in self._directory.pools.values()]
        else:
            await self._forget_unlisted({pool.name for pool, _ in listing})
        await asyncio.gather(*(self._refresh_pool_logged(pool, tenants) for pool, tenants in listing))

    async def _refresh_pool_logged(self, pool: PoolSnapshot, tenants: list[TenantQuota]) -> None:
        try:
            await self._refresh_pool(pool, tenants)
        except Exception:  # noqa: BLE001 - one pool's failure must not freeze the others
            log.exception("pool %s: stats poll failed; its last state is kept", pool.name)

    async def _forget_unlisted(self, listed: set[str]) -> None:
        """Drop every pool name the registry no longer lists (deleted, or renamed: its new name
        is listed): its state here, in the directory and its route, so neither its metric series
        (pool and replica) nor its SLO guard (``SloGuards`` follows ``directory.pools``) nor its
        peer-sync heartbeats outlive it. A pool in use reappears in the next listing; a request
        that raced the listing only re-registers its pool. The pool's miss-ratio curve goes too."""
        for name in [n for n in self._directory.pools if n not in listed]:
            self._directory.forget(name)
        for name in [n for n in self._routing.pools if n not in listed]:
            await self._routing.forget(name)
        if self._curves is not None:
            self._curves.retain(listed)
        for state in (self._stats, self._quotas, self._trackers, self.last_refresh, self.engine_up, self._capacity,
                      self._replicas):
            for name in [n for n in state if n not in listed]:
                del state[name]

    async def _refresh_pool(self, pool: PoolSnapshot, tenants: list[TenantQuota]) -> None:
        self._directory.register(pool)
        stats = await self._routing.poll(pool)
        self.engine_up[pool.name] = stats is not None  # any replica answered its stats call
        # The engine counters on /metrics: per replica, in rotation or not (a sum over the replicas
        # in rotation goes down when one leaves, which Prometheus reads as a counter reset).
        self._replicas[pool.name] = self._routing.route(pool).last_reports()
        if stats is None:
            return  # no replica answered: keep the last known state (engines restarting)
        self.apply(pool, stats, tenants, self._routing.route(pool).replica_reports())

    def snapshots(self) -> list[PoolSnapshot]:
        out = []
        for name, stats in list(self._stats.items()):  # a copy: /metrics reads this from a worker thread
            quotas = self._quotas.get(name, {})
            capacity = stats.primary.max_blocks
            out.append(PoolSnapshot(
                pool=name, stats=stats,
                tenant_slugs={tid: q.slug for tid, q in quotas.items()},
                tenant_quota_blocks={q.slug: q.kv_quota_fraction * capacity for q in quotas.values()},
                demoted={q.slug: self.quota_state(name, q.tenant_id).over_quota for q in quotas.values()},
                capacity=self._capacity.get(name),
                replicas=self._replicas.get(name, {}),
            ))
        return out
