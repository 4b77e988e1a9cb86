"""The gateway's SloGuards without an engine: plans rolled back while tripped and for the
pilot's rollback arm, trip/restore audited in a real registry, the tripped gauge, the view.

Observations and time are fed directly (a settable clock); the end-to-end behaviour with a
real engine is tests/server/gateway/test_slo_guard_e2e.py.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select

from engines.contract import KvMetrics
from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention
from retention.rollout.pilot import pilot_arm
from server.gateway.admission import Limits
from server.gateway.context import TenantContext
from server.gateway.observe.slo_guard import SloGuards
from tenants import list_pool_snapshots, slo
from tenants.models import AuditEvent
from tests.tenants.factories import ACTOR, make_pool, now
from tests.tenants.fixtures import _postgres_db, _sqlite_db, db, session  # noqa: F401

CLASS = RetentionClassSpec(SegmentRetention(90), SegmentRetention(60, 600_000), SegmentRetention(40, 30_000),
                           SegmentRetention(20, 30_000))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _tenant(pool, tenant_id: int) -> TenantContext:  # type: ignore[no-untyped-def]
    return TenantContext(tenant_id, f"t{tenant_id}", "active", "salted", "salt", Limits(), 1.0, pool, CLASS, 1)


def test_trip_rolls_plans_back_audits_and_restores(db, session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                   values={"ttft_p99_ms": 500, "window_seconds": 5, "min_requests": 3, "cooldown_seconds": 10})
    snapshots = list_pool_snapshots(session)
    pool = snapshots[0]
    clock, registry = Clock(), CollectorRegistry()
    guards = SloGuards(session_factory=db.factory, pools=lambda: snapshots, registry=registry, clock=clock)
    tenant = _tenant(pool, 7)
    plan = plan_retention(CLASS, Segments(32, 48, 64), offload_min_priority=pool.secondary_offload_min_priority)

    def request(ttft: float) -> str:
        used, arm = guards.apply(tenant, plan)
        guards.observe(pool.name, arm, ttft=ttft, inter_token=0.01, kv=KvMetrics(4, 0, 4, 4))
        return arm if used == plan else f"{arm}*"

    assert request(0.9) == "host"  # the plan is untouched while not tripped
    for _ in range(12):
        clock.t += 1
        request(0.9)
        asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-a": True}
    assert 'kvgate_slo_guard_tripped{pool="gpu-a"} 1.0' in generate_latest(registry).decode()
    used, arm = guards.apply(tenant, plan)
    assert arm == "rollback" and all(r.priority < pool.secondary_offload_min_priority for r in used.ranges)
    view = guards.view("gpu-a")
    assert view["tripped"] and view["trips"] == 1 and "ttft p99 900 ms > 500 ms" in view["last_reason"]
    assert view["pilot"]["host"]["host_hits"] > 0

    for _ in range(12):  # fast again, but the cool-down (10 s) holds it until t >= trip + 10
        clock.t += 1
        request(0.1)
        asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-a": False}
    assert asyncio.run(guards.admin_restore("gpu-a", actor="ops")) is False  # not tripped: nothing to do
    events = session.scalars(select(AuditEvent).where(AuditEvent.entity_type == "pool_slo").order_by(AuditEvent.id)).all()
    assert [(e.action, e.actor) for e in events][-2:] == [("pool_slo.trip", "gateway:slo-guard"),
                                                          ("pool_slo.restore", "gateway:slo-guard")]
    assert events[-2].after["ttft_p99_ms"] == 900.0 and events[-2].entity_id == str(pool.id)


def test_admin_restore_and_budget_removal(db, session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                   values={"ttft_p99_ms": 500, "window_seconds": 2, "min_requests": 1, "cooldown_seconds": 600})
    snapshots = list_pool_snapshots(session)
    pool = snapshots[0]
    clock = Clock()
    guards = SloGuards(session_factory=db.factory, pools=lambda: snapshots, registry=CollectorRegistry(), clock=clock)
    tenant = _tenant(pool, 3)

    def trip() -> None:
        for _ in range(4):
            clock.t += 1
            _, arm = guards.apply(tenant, plan_retention(CLASS, Segments(8, 8, 16), offload_min_priority=35))
            guards.observe(pool.name, arm, ttft=2.0, inter_token=None, kv=None)
            asyncio.run(guards.tick())
        assert guards.tripped()["gpu-a"]

    trip()
    assert asyncio.run(guards.admin_restore("gpu-a", actor="ops")) is True
    assert not guards.tripped()["gpu-a"]
    trip()
    slo.delete_budget(session, actor=ACTOR, now=now(), pool="gpu-a")
    snapshots[:] = list_pool_snapshots(session)
    asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-a": False} and guards.view("gpu-a")["configured"] is False
    actions = [(e.action, e.actor) for e in session.scalars(
        select(AuditEvent).where(AuditEvent.action.in_(["pool_slo.trip", "pool_slo.restore"])).order_by(AuditEvent.id))]
    assert actions == [("pool_slo.trip", "gateway:slo-guard"), ("pool_slo.restore", "ops"),
                       ("pool_slo.trip", "gateway:slo-guard"), ("pool_slo.restore", "gateway:slo-guard")]


def test_pilot_split_rolls_back_only_the_control_arm(db, session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"pilot_fraction": 0.5})
    pool = list_pool_snapshots(session)[0]
    guards = SloGuards(session_factory=db.factory, pools=lambda: [pool], registry=CollectorRegistry(), clock=Clock())
    plan = plan_retention(CLASS, Segments(8, 8, 16), offload_min_priority=35)
    arms = {}
    for tenant_id in range(1, 41):
        used, arm = guards.apply(_tenant(pool, tenant_id), plan)
        assert arm == pilot_arm(str(tenant_id), 0.5)
        assert (used == plan) == (arm == "host")
        arms[arm] = arms.get(arm, 0) + 1
    assert arms["host"] > 5 and arms["rollback"] > 5
