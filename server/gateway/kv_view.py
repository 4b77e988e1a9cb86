"""What this gateway process knows of KV, as plain JSON-able dicts for the admin API.

The figures are the engines' own (per-tenant blocks per tier from the stats call, the
per-request KV metrics each response carries) plus the miss-ratio curves' shadows; the
same numbers ``/metrics`` exports, readable per tenant and per pool with an admin
credential instead of the metrics token. Installed on the admin sub-app as
``app.state.kv_view`` by ``server.gateway.app.install_gateway``; ``server/admin/kv.py``
serves it.

Invariant: nothing here calls an engine; every read is the latest poll's snapshot, so a
console refreshing every few seconds costs the engines nothing.
"""

from __future__ import annotations

from typing import Any

from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.observe.miss_ratio import MissRatioCurves
from server.gateway.replicas.pool_monitor import PoolMonitor
from server.gateway.replicas.routing import Routing


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class KvView:
    def __init__(self, *, monitor: PoolMonitor, metrics: GatewayMetrics, routing: Routing,
                 curves: MissRatioCurves | None) -> None:
        self._monitor = monitor
        self._metrics = metrics
        self._routing = routing
        self._curves = curves

    def _curve(self, pool: str, tenant_id: str | None) -> list[dict[str, Any]]:
        """The pool's miss-ratio-curve points (``tenant_id``: that tenant's hit rates only)."""
        curve = None if self._curves is None else self._curves.curves().get(pool)
        if curve is None:
            return []
        out = []
        for point in curve.points:
            shadow = point.shadow
            counts = shadow.counts if tenant_id is None else shadow.tenants.get(tenant_id)
            out.append({
                "gpu": point.gpu, "host": point.host,
                "primary_blocks": shadow.primary_blocks, "secondary_blocks": shadow.secondary_blocks,
                "hit_rate": None if counts is None else counts.hit_rate(),
                "hit_rate_stderr": None if counts is None else counts.hit_rate_stderr(),
                "host_hit_rate": None if counts is None else counts.host_hit_rate(),
            })
        return out

    def tenant(self, *, pool: str, tenant_id: int, slug: str, kv_quota_fraction: float) -> dict[str, Any]:
        """One tenant's KV on its pool: blocks per tier, quota share, hit rates, its curve."""
        stats = self._monitor.stats(pool)
        engine_id = str(tenant_id)
        primary, secondary = (stats.tenants.get(engine_id, [0, 0]) if stats is not None else [0, 0])[:2]
        quota_blocks = kv_quota_fraction * stats.primary.max_blocks if stats is not None else None
        totals = self._metrics.tenant_kv.get((tenant_id, pool))  # by id: a reused slug starts from zero
        requests, reused, new, onboarded = totals if totals is not None else (0, 0, 0, 0)
        return {
            "polled": stats is not None,
            "engine_up": self._monitor.engine_up.get(pool),
            "primary_blocks": primary, "secondary_blocks": secondary,
            "pool_primary_blocks": None if stats is None else stats.primary.max_blocks,
            "pool_secondary_blocks": None if stats is None else stats.secondary.max_blocks,
            "quota_blocks": quota_blocks,
            "quota_share": None if not quota_blocks else primary / quota_blocks,
            "demoted": self._monitor.quota_state(pool, tenant_id).over_quota,
            "requests": requests, "reused_blocks": reused, "new_blocks": new, "onboarded_blocks": onboarded,
            "hit_rate": _ratio(reused, reused + new),
            "host_hit_share": _ratio(onboarded, reused),
            "pool_hit_rate": None if stats is None else stats.cache_hit_rate,
            "mrc": self._curve(pool, engine_id),
        }

    def pool(self, pool: str) -> dict[str, Any]:
        """The pool's tiers, counters, per-tenant blocks, replicas as this gateway sees them, and its curve."""
        stats = self._monitor.stats(pool)
        slugs = self._monitor.tenant_slugs(pool)
        route = self._routing.pools.get(pool)
        modes = {True: "precise", False: "approximate", None: "unknown"}
        replicas = [] if route is None else [
            {"name": r.name, "state": r.state, "breaker": r.breaker.state, "healthy": r.breaker.closed,
             "in_flight": r.in_flight, "indexed": modes[r.events], "reporting": r.stats is not None}
            for r in list(route.replicas.values())]
        tiers = None if stats is None else {
            name: {"used_blocks": t.used_blocks, "free_blocks": t.free_blocks, "max_blocks": t.max_blocks}
            for name, t in (("primary", stats.primary), ("secondary", stats.secondary))}
        return {
            "polled": stats is not None,
            "engine_up": self._monitor.engine_up.get(pool),
            "tiers": tiers,
            "cache_hit_rate": None if stats is None else stats.cache_hit_rate,
            "counters": None if stats is None else {
                name: getattr(stats, f"{name}_blocks") for name in ("reused", "missed", "offloaded", "onboarded", "evicted")},
            "tenants": [] if stats is None else [
                {"tenant": slugs[tid], "primary_blocks": c[0], "secondary_blocks": c[1]}
                for tid, c in sorted(stats.tenants.items()) if tid in slugs],
            "replicas": replicas,
            "mrc": self._curve(pool, None),
        }
