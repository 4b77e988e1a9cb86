"""The gateway's SLO guards: one ``retention.rollout.guard.SloGuard`` per pool with a budget.

* **plans** — :meth:`SloGuards.apply` runs on every request after the plan is built: the
  tenant's pilot arm (``retention.rollout.pilot``) and the pool's guard decide whether
  the plan keeps the host tier or is rolled back (``retention.policy.planner.roll_back_host_tier``:
  every new block below the pool's offload threshold, so evicted blocks are dropped);
* **observations** — :meth:`SloGuards.observe` records each finished request's TTFT and
  mean inter-token latency (O(1));
* **evaluation** — :meth:`SloGuards.tick` (a background loop) takes the budgets from the
  latest registry snapshots, evaluates every guard, and writes an audit event for each
  trip and restore (actor ``gateway:slo-guard``);
* **state** — :meth:`SloGuards.view` / :meth:`SloGuards.admin_restore` for the admin API,
  ``kvgate_slo_guard_tripped{pool}`` and the per-arm series for Prometheus.

The state is per gateway process: each replica guards on the traffic it serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from engines.contract import KvMetrics
from retention.policy.planner import roll_back_host_tier
from retention.rollout.guard import ARM_HOST, ARM_ROLLBACK, GuardTransition, Observation, SloBudget, SloGuard
from retention.rollout.pilot import PilotReport, pilot_arm
from retention.types import RetentionPlan
from server.gateway.context import TenantContext
from server.gateway.observe.metrics import SloGuardMetrics, cache_outcome
from tenants.slo import record_guard_event
from tenants.snapshots import PoolSnapshot

log = logging.getLogger("kvgate.gateway.slo_guard")
GUARD_ACTOR = "gateway:slo-guard"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class SloGuards:
    def __init__(self, *, session_factory, pools: Callable[[], Iterable[PoolSnapshot]], registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._session_factory = session_factory
        self._pools = pools
        self._clock = clock
        self._wall = wall
        self._guards: dict[str, SloGuard] = {}
        self._reports: dict[str, PilotReport] = {}
        self._pool_ids: dict[str, int] = {}
        self.metrics = SloGuardMetrics(registry, self.tripped)

    def tripped(self) -> dict[str, bool]:
        """Every known pool (False without a budget), so the series exists before any trip."""
        out = {pool.name: False for pool in self._pools()}
        out.update((pool, guard.tripped) for pool, guard in self._guards.items())
        return out

    def _guard(self, pool: PoolSnapshot) -> SloGuard | None:
        guard = self._guards.get(pool.name)
        if guard is None and pool.slo is not None:  # first request before the first tick
            guard = self._start(pool.name, pool.slo)
        return guard

    def _start(self, name: str, budget: SloBudget) -> SloGuard:
        guard = self._guards[name] = SloGuard(budget)
        self._reports[name] = PilotReport(budget.window_seconds)
        return guard

    # Hot path ---------------------------------------------------------------------------
    def apply(self, tenant: TenantContext, plan: RetentionPlan) -> tuple[RetentionPlan, str | None]:
        """The plan this request runs with, and its arm (``None``: the pool has no budget)."""
        pool = tenant.pool
        guard = self._guard(pool)
        if guard is None:
            return plan, None
        if guard.tripped or pilot_arm(tenant.engine_tenant_id, guard.budget.pilot_fraction) == ARM_ROLLBACK:
            return roll_back_host_tier(plan, pool.secondary_offload_min_priority), ARM_ROLLBACK
        return plan, ARM_HOST

    def observe(self, pool: str, arm: str | None, *, ttft: float | None, inter_token: float | None,
                kv: KvMetrics | None) -> None:
        if arm is None:
            return
        guard = self._guards.get(pool)
        if guard is None:
            return
        cache = cache_outcome(kv)
        observation = Observation(self._clock(), ttft, inter_token, arm, cache)
        guard.observe(observation)
        self._reports[pool].observe(observation)
        self.metrics.observe(pool=pool, arm=arm, ttft=ttft, inter_token=inter_token, cache=cache)

    # Evaluation ---------------------------------------------------------------------------
    async def tick(self) -> None:
        """Take the latest budgets, evaluate every guard, audit the transitions."""
        now = self._clock()
        transitions: list[tuple[str, GuardTransition]] = []
        for pool in list(self._pools()):
            self._pool_ids[pool.name] = pool.id
            guard = self._guards.get(pool.name)
            if pool.slo is None:
                if guard is not None:
                    transition = guard.restore(now, "SLO budget removed")
                    if transition is not None:
                        transitions.append((pool.name, transition))
                    self._guards.pop(pool.name, None)
                    self._reports.pop(pool.name, None)
                continue
            if guard is None:
                guard = self._start(pool.name, pool.slo)
            else:
                changed = guard.configure(pool.slo, now)
                if changed is not None:
                    transitions.append((pool.name, changed))
                if self._reports[pool.name].window_seconds != pool.slo.window_seconds:
                    self._reports[pool.name] = PilotReport(pool.slo.window_seconds)
            transition = guard.evaluate(now)
            if transition is not None:
                transitions.append((pool.name, transition))
        for name, transition in transitions:
            await self._audit(name, transition, GUARD_ACTOR)

    async def admin_restore(self, pool: str, *, actor: str) -> bool:
        """Restore the pool's host tier now; False if it was not tripped."""
        guard = self._guards.get(pool)
        transition = None if guard is None else guard.restore(self._clock(), f"restored by {actor}")
        if transition is None:
            return False
        await self._audit(pool, transition, actor)
        return True

    async def _audit(self, pool: str, transition: GuardTransition, actor: str) -> None:
        action = "trip" if transition.tripped else "restore"
        log.warning("SLO guard %s pool %s: %s", action, pool, transition.reason)
        pool_id = self._pool_ids.get(pool)
        if pool_id is None:
            return
        w = transition.window
        after = {"tripped": transition.tripped, "reason": transition.reason, "ttft_p99_ms": _ms(w.ttft_p99),
                 "itl_p99_ms": _ms(w.itl_p99), "ttft_samples": w.ttft_samples, "itl_samples": w.itl_samples}

        def write() -> None:
            with self._session_factory() as session:
                record_guard_event(session, actor=actor, now=self._wall(), pool_id=pool_id, action=action,
                                   before={"tripped": not transition.tripped}, after=after)

        try:
            await anyio.to_thread.run_sync(write)
        except Exception:  # the registry may be down: the guard still acts, the log has the event
            log.exception("could not audit the SLO guard %s of pool %s", action, pool)

    # Views ------------------------------------------------------------------------------
    def view(self, pool: str) -> dict[str, Any]:
        """JSON-able state of the pool's guard in this process."""
        guard = self._guards.get(pool)
        if guard is None:
            return {"pool": pool, "configured": False, "tripped": False}
        now, wall = self._clock(), self._wall()

        def at(t: float | None) -> str | None:
            return None if t is None else (wall - timedelta(seconds=now - t)).isoformat()

        state = guard.state(now)
        w = state.window
        arms = {
            arm: {"requests": s.requests, "ttft_p50_ms": _ms(s.ttft_p50), "ttft_p99_ms": _ms(s.ttft_p99),
                  "itl_p99_ms": _ms(s.itl_p99), "gpu_hits": s.gpu_hits, "host_hits": s.host_hits, "misses": s.misses,
                  "hit_ratio": s.hit_ratio}
            for arm, s in self._reports[pool].summary(now).items()
        }
        b = guard.budget
        return {
            "pool": pool, "configured": True, "tripped": state.tripped, "since": at(state.since),
            "breaking_since": at(state.breach_since), "last_reason": state.last_reason, "trips": state.trips,
            "restores": state.restores,
            "budget": {"ttft_p99_ms": b.ttft_p99_ms, "itl_p99_ms": b.itl_p99_ms, "window_seconds": b.window_seconds,
                       "min_requests": b.min_requests, "cooldown_seconds": b.cooldown_seconds,
                       "hysteresis": b.hysteresis, "enabled": b.enabled, "pilot_fraction": b.pilot_fraction},
            "window": {"ttft_samples": w.ttft_samples, "itl_samples": w.itl_samples, "ttft_p99_ms": _ms(w.ttft_p99),
                       "itl_p99_ms": _ms(w.itl_p99)},
            "pilot": arms,
        }
