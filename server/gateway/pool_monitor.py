"""Polls every pool's engine stats; derives per-tenant KV quota state with hysteresis.

A tenant is *over quota* on a pool when the primary (GPU) blocks it holds exceed
``kv_quota_fraction × primary_blocks``. Once over, it stays demoted until it falls
below ``low_watermark ×`` that share, so it does not flap around the line. The state
is a function of the engines' per-tenant block counts, so after a gateway restart the
first poll rebuilds it (a tenant above its quota is demoted again at once; one between
the watermarks starts undemoted and is demoted again if it crosses its quota).
"""

from __future__ import annotations

import time

import anyio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engines.contract import PoolStatsReport
from retention.planner import QuotaState
from server.gateway.context import PoolRef
from server.gateway.engine_client import EngineError
from server.gateway.engines import EngineDirectory
from server.gateway.metrics import PoolSnapshot


@dataclass(frozen=True, slots=True)
class TenantQuota:
    tenant_id: int
    slug: str
    kv_quota_fraction: float


class PoolMonitor:
    def __init__(self, directory: EngineDirectory,
                 pools_and_tenants: Callable[[], list[tuple[PoolRef, list[TenantQuota]]]], *,
                 low_watermark: float = 0.9, clock: Callable[[], float] = time.monotonic) -> None:
        self._directory = directory
        self._pools_and_tenants = pools_and_tenants  # sync (reads the registry); run in a thread
        self._low = low_watermark
        self._clock = clock
        self._stats: dict[str, PoolStatsReport] = {}
        self._quotas: dict[str, dict[str, TenantQuota]] = {}
        self._demoted: dict[tuple[str, int], bool] = {}
        self.last_refresh: dict[str, float] = {}

    def quota_state(self, pool: str, tenant_id: int) -> QuotaState:
        return QuotaState(over_quota=self._demoted.get((pool, tenant_id), False))

    def stats(self, pool: str) -> PoolStatsReport | None:
        return self._stats.get(pool)

    def apply(self, pool: PoolRef, stats: PoolStatsReport, tenants: Iterable[TenantQuota]) -> None:
        """Fold one stats report into the quota state (pure apart from self)."""
        self._stats[pool.name] = stats
        quotas = {str(t.tenant_id): t for t in tenants}
        self._quotas[pool.name] = quotas
        capacity = stats.primary.max_blocks or pool.primary_blocks
        for engine_id, quota in quotas.items():
            held = stats.tenants.get(engine_id, [0, 0])[0]
            allowed = quota.kv_quota_fraction * capacity
            key = (pool.name, quota.tenant_id)
            if self._demoted.get(key, False):
                self._demoted[key] = held >= self._low * allowed
            else:
                self._demoted[key] = held > allowed
        self.last_refresh[pool.name] = self._clock()

    async def refresh(self) -> None:
        """Poll every registered pool once. Registry or engine failures keep the last state."""
        try:
            listing = await anyio.to_thread.run_sync(self._pools_and_tenants)
        except Exception:  # registry down: keep polling the pools we know, with their last tenants
            listing = [(pool, list(self._quotas.get(pool.name, {}).values())) for pool in self._directory.pools.values()]
        for pool, tenants in listing:
            self._directory.register(pool)
            try:
                stats = await self._directory.client(pool).stats()
            except EngineError:
                continue  # keep the last known state; the engine may be restarting
            self.apply(pool, stats, tenants)

    def snapshots(self) -> list[PoolSnapshot]:
        out = []
        for name, stats in self._stats.items():
            quotas = self._quotas.get(name, {})
            capacity = stats.primary.max_blocks
            out.append(PoolSnapshot(
                pool=name, stats=stats,
                tenant_slugs={tid: q.slug for tid, q in quotas.items()},
                tenant_quota_blocks={q.slug: q.kv_quota_fraction * capacity for q in quotas.values()},
                demoted={q.slug: self._demoted.get((name, q.tenant_id), False) for q in quotas.values()},
            ))
        return out
