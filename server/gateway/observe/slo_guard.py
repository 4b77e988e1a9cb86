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

A guard is its pool's, keyed by the pool's id: a renamed pool keeps its state (a trip, its
cool-down, its counts) under the new name; a pool gone from the poll loses its guard (a
tripped one is restored, audited) and its series.

The state is per gateway process: each replica guards on the traffic it serves, and a
restarted gateway starts untripped (writing no restore event). Trip and restore events name
the process (``gateway``: host, pid and a random suffix), so a trip that no restore from the
same gateway follows ended with that process.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
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
    """The guards of this gateway process, one per pool with a budget, keyed by the pool's id."""

    def __init__(self, *, session_factory, pools: Callable[[], Iterable[PoolSnapshot]], registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC), gateway: str | None = None) -> None:
        self._session_factory = session_factory
        self._pools = pools
        self._clock = clock
        self._wall = wall
        # This process, as its audit events name it (the format of the routing sync's gateway id).
        self.gateway = gateway or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._guards: dict[int, SloGuard] = {}
        self._reports: dict[int, PilotReport] = {}
        self._names: dict[int, str] = {}  # pool id -> its name as of the latest poll
        self._ids: dict[str, int] = {}  # a live pool's names (the current one and any it had before) -> its id
        self._series: dict[str, int] = {}  # pool label of the per-arm series -> the id of the pool they count
        self.metrics = SloGuardMetrics(registry, self.tripped)

    def _polled(self) -> dict[int, PoolSnapshot]:
        """The latest poll, one snapshot per pool id (a source that repeats an id: the last one)."""
        return {pool.id: pool for pool in self._pools()}

    def tripped(self) -> dict[str, bool]:
        """Every pool of the latest poll, by its current name (False without a budget), so the series
        exists before any trip and goes with the pool."""
        return {pool.name: (guard := self._guards.get(pool_id)) is not None and guard.tripped
                for pool_id, pool in self._polled().items()}

    def _guard(self, pool: PoolSnapshot) -> SloGuard | None:
        guard = self._guards.get(pool.id)
        if guard is None and pool.slo is not None:  # first request before the first tick
            guard = self._start(pool, pool.slo)
        return guard

    def _start(self, pool: PoolSnapshot, budget: SloBudget) -> SloGuard:
        guard = self._guards[pool.id] = SloGuard(budget)
        self._reports[pool.id] = PilotReport(budget.window_seconds)
        self._names.setdefault(pool.id, pool.name)
        self._ids.setdefault(pool.name, pool.id)
        return guard

    def _id(self, pool: str | int) -> int | None:
        return pool if isinstance(pool, int) else self._ids.get(pool)

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
        """A finished request of ``pool`` (its name when planned: a renamed pool's old name still
        finds it). A request that failed before its first token comes with the time it waited as
        its TTFT (``CompletionRunner._finish``)."""
        if arm is None:
            return
        pool_id = self._ids.get(pool)
        guard = None if pool_id is None else self._guards.get(pool_id)
        if guard is None:
            return
        cache = cache_outcome(kv)
        observation = Observation(self._clock(), ttft, inter_token, arm, cache)
        guard.observe(observation)
        self._reports[pool_id].observe(observation)
        label = self._names.get(pool_id, pool)
        self._series[label] = pool_id
        self.metrics.observe(pool=label, arm=arm, ttft=ttft, inter_token=inter_token, cache=cache)

    # Evaluation ---------------------------------------------------------------------------
    async def tick(self) -> None:
        """Take the latest budgets, evaluate every guard, audit the transitions. A pool gone from
        the poll loses its guard (a tripped one is restored, audited) and its series; a renamed
        pool keeps its guard (same id), its series move to the new name."""
        now = self._clock()
        polled = self._polled()
        transitions: list[tuple[int, str, GuardTransition]] = []
        for pool_id in [pool_id for pool_id in self._guards if pool_id not in polled]:
            guard = self._guards.pop(pool_id)
            self._reports.pop(pool_id, None)
            transition = guard.restore(now, "pool no longer in the registry")
            if transition is not None:
                transitions.append((pool_id, self._names.get(pool_id, str(pool_id)), transition))
        self._names = {pool_id: pool.name for pool_id, pool in polled.items()}
        self._ids = {name: pool_id for name, pool_id in self._ids.items() if pool_id in polled}
        self._ids.update((pool.name, pool_id) for pool_id, pool in polled.items())
        for label, pool_id in list(self._series.items()):
            if self._names.get(pool_id) != label:  # the pool is gone or renamed
                self._drop_series(label)
        for pool_id, pool in polled.items():
            guard = self._guards.get(pool_id)
            if pool.slo is None:
                if guard is not None:
                    transition = guard.restore(now, "SLO budget removed")
                    if transition is not None:
                        transitions.append((pool_id, pool.name, transition))
                    self._guards.pop(pool_id, None)
                    self._reports.pop(pool_id, None)
                continue
            if guard is None:
                guard = self._start(pool, pool.slo)
            else:
                changed = guard.configure(pool.slo, now)
                if changed is not None:
                    transitions.append((pool_id, pool.name, changed))
                if self._reports[pool_id].window_seconds != pool.slo.window_seconds:
                    self._reports[pool_id] = PilotReport(pool.slo.window_seconds)
            transition = guard.evaluate(now)
            if transition is not None:
                transitions.append((pool_id, pool.name, transition))
        for pool_id, name, transition in transitions:
            await self._audit(pool_id, name, transition, GUARD_ACTOR)

    def _drop_series(self, label: str) -> None:
        del self._series[label]
        for metric in (self.metrics.ttft, self.metrics.inter_token, self.metrics.requests):
            metric.remove_by_labels({"pool": label})

    async def admin_restore(self, pool: str, *, actor: str, pool_id: int | None = None) -> bool:
        """Restore the pool's host tier now; False if it was not tripped. ``pool`` is its name,
        ``pool_id`` (when given) finds its guard whatever name this process last polled."""
        pool_id = self._id(pool if pool_id is None else pool_id)
        guard = None if pool_id is None else self._guards.get(pool_id)
        transition = None if guard is None else guard.restore(self._clock(), f"restored by {actor}")
        if transition is None or pool_id is None:
            return False
        await self._audit(pool_id, pool, transition, actor)
        return True

    async def _audit(self, pool_id: int, pool: str, transition: GuardTransition, actor: str) -> None:
        action = "trip" if transition.tripped else "restore"
        log.warning("SLO guard %s pool %s (gateway %s): %s", action, pool, self.gateway, transition.reason)
        w = transition.window
        after = {"tripped": transition.tripped, "reason": transition.reason, "ttft_p99_ms": _ms(w.ttft_p99),
                 "itl_p99_ms": _ms(w.itl_p99), "ttft_samples": w.ttft_samples, "itl_samples": w.itl_samples,
                 "gateway": self.gateway}

        def write() -> None:
            with self._session_factory() as session:
                record_guard_event(session, actor=actor, now=self._wall(), pool_id=pool_id, action=action,
                                   before={"tripped": not transition.tripped}, after=after)

        try:
            await anyio.to_thread.run_sync(write)
        except Exception:  # the registry may be down: the guard still acts, the log has the event
            log.exception("could not audit the SLO guard %s of pool %s", action, pool)

    # Views ------------------------------------------------------------------------------
    def view(self, pool: str, *, pool_id: int | None = None) -> dict[str, Any]:
        """JSON-able state of the pool's guard in this process. ``pool`` is the name shown (and
        looked up when ``pool_id`` is not given)."""
        pool_id = self._id(pool if pool_id is None else pool_id)
        guard = None if pool_id is None else self._guards.get(pool_id)
        if guard is None or pool_id is None:
            return {"pool": pool, "configured": False, "tripped": False, "gateway": self.gateway}
        now, wall = self._clock(), self._wall()

        def at(t: float | None) -> str | None:
            return None if t is None else (wall - timedelta(seconds=now - t)).isoformat()

        state = guard.state(now)
        w = state.window
        arms = {
            arm: {"requests": s.requests, "ttft_p50_ms": _ms(s.ttft_p50), "ttft_p99_ms": _ms(s.ttft_p99),
                  "itl_p99_ms": _ms(s.itl_p99), "gpu_hits": s.gpu_hits, "host_hits": s.host_hits, "misses": s.misses,
                  "hit_ratio": s.hit_ratio}
            for arm, s in self._reports[pool_id].summary(now).items()
        }
        b = guard.budget
        return {
            "pool": pool, "gateway": self.gateway, "configured": True, "tripped": state.tripped,
            "since": at(state.since), "breaking_since": at(state.breach_since), "last_reason": state.last_reason,
            "trips": state.trips, "restores": state.restores,
            "budget": {"ttft_p99_ms": b.ttft_p99_ms, "itl_p99_ms": b.itl_p99_ms, "window_seconds": b.window_seconds,
                       "min_requests": b.min_requests, "cooldown_seconds": b.cooldown_seconds,
                       "hysteresis": b.hysteresis, "enabled": b.enabled, "pilot_fraction": b.pilot_fraction},
            "window": {"ttft_samples": w.ttft_samples, "itl_samples": w.itl_samples, "ttft_p99_ms": _ms(w.ttft_p99),
                       "itl_p99_ms": _ms(w.itl_p99)},
            "pilot": arms,
        }
