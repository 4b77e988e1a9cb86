"""The gateway's SloGuards without an engine: plans rolled back while tripped and for the
pilot's rollback arm, trip/restore audited in a real registry, the tripped gauge, the view,
pools renamed and deleted; and what the hot path (``CompletionRunner``, over an engine double
that fails) feeds the guard.

Observations and time are fed directly (a settable clock); the end-to-end behaviour with a
real engine is tests/server/gateway/test_slo_guard_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select

from engines.contract import KvMetrics
from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention
from retention.rollout.pilot import pilot_arm
from server.gateway.admission import Limits
from server.gateway.context import TenantContext
from server.gateway.observe.slo_guard import SloGuards
from server.gateway.replicas.engine_client import EngineRejected, EngineTimeout, EngineUnavailable
from tenants import list_pool_snapshots, pools, slo
from tenants.models import AuditEvent
from tests.server.gateway.scripted import TextTokenizer
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


def _tripped_guards(session, db, **budget):  # type: ignore[no-untyped-def]
    """Pool gpu-a's guard tripped (slow requests for a whole window); the poll is ``holder["snaps"]``."""
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                   values={"ttft_p99_ms": 500, "window_seconds": 5, "min_requests": 3, "cooldown_seconds": 10,
                           **budget})
    holder = {"snaps": list_pool_snapshots(session)}
    clock, registry = Clock(), CollectorRegistry()
    guards = SloGuards(session_factory=db.factory, pools=lambda: holder["snaps"], registry=registry, clock=clock)
    pool = holder["snaps"][0]
    tenant = _tenant(pool, 7)
    plan = plan_retention(CLASS, Segments(32, 48, 64), offload_min_priority=pool.secondary_offload_min_priority)
    for _ in range(12):
        clock.t += 1
        _, arm = guards.apply(tenant, plan)
        guards.observe(pool.name, arm, ttft=0.9, inter_token=0.01, kv=KvMetrics(4, 0, 4, 4))
        asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-a": True}
    return guards, holder, clock, registry


def _series(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith(("kvgate_slo_guard_tripped{", "kvgate_pilot_")) and 'pool="' in line]


def _guard_events(session) -> list[AuditEvent]:  # type: ignore[no-untyped-def]
    return session.scalars(select(AuditEvent).where(AuditEvent.action.in_(["pool_slo.trip", "pool_slo.restore"]))
                           .order_by(AuditEvent.id)).all()


def test_a_renamed_pool_keeps_its_guard_state_under_its_new_name(db, session) -> None:  # type: ignore[no-untyped-def]
    """The guard is the pool's (its id), not its name's: a rename carries the trip, its cool-down
    and its counts over, with no restore; the old name's series go."""
    guards, holder, clock, registry = _tripped_guards(session, db)
    pools.update_pool(session, actor=ACTOR, now=now(), ref="gpu-a", changes={"name": "gpu-b"},
                      version=pools.get_pool(session, ref="gpu-a").version)
    holder["snaps"] = list_pool_snapshots(session)
    for _ in range(3):  # within the cool-down (10 s): still tripped, whatever the traffic
        clock.t += 1
        asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-b": True}
    series = _series(registry)
    assert 'kvgate_slo_guard_tripped{pool="gpu-b"} 1.0' in series
    assert not [line for line in series if 'pool="gpu-a"' in line], series
    view = guards.view("gpu-b")
    assert (view["pool"], view["tripped"], view["trips"], view["restores"]) == ("gpu-b", True, 1, 0)
    pool = holder["snaps"][0]
    _, arm = guards.apply(_tenant(pool, 7), plan_retention(CLASS, Segments(8, 8, 16), offload_min_priority=35))
    assert arm == "rollback"
    before = guards.view("gpu-b")["pilot"]["rollback"]["requests"]
    guards.observe("gpu-a", arm, ttft=0.1, inter_token=None, kv=None)  # planned before the rename, finished after
    assert guards.view("gpu-b")["pilot"]["rollback"]["requests"] == before + 1
    assert not [line for line in _series(registry) if 'pool="gpu-a"' in line]  # counted under the new name
    assert [e.action for e in _guard_events(session)] == ["pool_slo.trip"]


def test_a_deleted_pool_loses_its_guard_and_its_series(db, session) -> None:  # type: ignore[no-untyped-def]
    guards, holder, clock, registry = _tripped_guards(session, db)
    pool_id = holder["snaps"][0].id
    holder["snaps"] = []  # the pool is gone from the registry poll
    clock.t += 1
    asyncio.run(guards.tick())
    assert guards.tripped() == {} and guards.view("gpu-a")["configured"] is False
    assert _series(registry) == []
    last = _guard_events(session)[-1]  # the trip is closed in the audit log
    assert (last.action, last.entity_id, last.after["tripped"]) == ("pool_slo.restore", str(pool_id), False)
    assert "no longer in the registry" in last.after["reason"]


def test_trip_and_restore_events_name_the_gateway(db, session) -> None:  # type: ignore[no-untyped-def]
    """The state is per gateway process (a restarted gateway starts untripped): each trip and
    restore event says which process it was."""
    guards, holder, clock, registry = _tripped_guards(session, db)
    assert asyncio.run(guards.admin_restore("gpu-a", actor="ops")) is True
    trip, restore = _guard_events(session)
    assert trip.after["gateway"] == restore.after["gateway"] == guards.gateway
    assert guards.view("gpu-a")["gateway"] == guards.gateway
    other = SloGuards(session_factory=db.factory, pools=lambda: holder["snaps"], registry=CollectorRegistry(),
                      clock=clock)
    assert other.gateway != guards.gateway and not other.tripped()["gpu-a"]  # a new process starts untripped


def test_pilot_the_rollback_arm_does_not_trip_the_host_tier(db, session) -> None:  # type: ignore[no-untyped-def]
    """pilot_fraction 0.5: the host arm is fast, the rollback arm (no host tier) slow. The trip is
    judged on the host arm: no trip; a slow host arm does trip."""
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                   values={"ttft_p99_ms": 500, "window_seconds": 5, "min_requests": 3, "cooldown_seconds": 10,
                           "pilot_fraction": 0.5})
    snapshots = list_pool_snapshots(session)
    clock = Clock()
    guards = SloGuards(session_factory=db.factory, pools=lambda: snapshots, registry=CollectorRegistry(), clock=clock)
    pool = snapshots[0]
    plan = plan_retention(CLASS, Segments(32, 48, 64), offload_min_priority=pool.secondary_offload_min_priority)
    tenants = [_tenant(pool, i) for i in range(1, 40)]

    def second(host: float, rollback: float) -> None:
        clock.t += 1
        for t in tenants:
            _, arm = guards.apply(t, plan)
            guards.observe(pool.name, arm, ttft=host if arm == "host" else rollback, inter_token=None, kv=None)
        asyncio.run(guards.tick())

    for _ in range(20):
        second(host=0.05, rollback=0.9)
    view = guards.view("gpu-a")
    assert not view["tripped"] and view["window"]["ttft_p99_ms"] == 50.0
    assert view["pilot"]["rollback"]["ttft_p99_ms"] == 900.0  # still reported side by side
    for _ in range(8):
        second(host=0.9, rollback=0.05)
    assert guards.tripped() == {"gpu-a": True}


class _FailingEngine:
    """Every call waits ``delay`` seconds, then fails before its first token with ``exc``
    (``None``: never answers)."""

    def __init__(self, exc: BaseException | None, delay: float = 0.02) -> None:
        self.exc, self.delay = exc, delay

    async def generate(self, request, *, request_id):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.delay if self.exc is not None else 3600)
        raise self.exc  # type: ignore[misc]
        yield  # an async generator, like EngineClient.generate


@pytest.mark.parametrize(("exc", "stream", "stop", "sampled"), [
    (EngineTimeout("no first token in time"), True, (), True),  # 504
    (EngineUnavailable("engine unavailable"), True, (), True),  # 503
    (EngineTimeout("no first token in time"), False, ("\n",), True),  # unary, streamed from the engine
    (EngineTimeout("no first token in time"), False, (), False),  # unary, one engine message: no TTFT ever
    (EngineRejected("prompt too long"), True, (), False),  # a refusal (400): says nothing of latency
    (None, True, (), False),  # the client left (499)
    (None, False, ("\n",), False),
])
def test_a_request_failing_before_its_first_token_is_over_the_ttft_budget(exc, stream, stop, sampled) -> None:
    """A request whose engine times out or fails before its first token is a TTFT sample of its
    elapsed time (at least the first-token deadline): a pool where most requests time out trips.
    Refusals and clients that left are not samples; nor are requests whose TTFT is never measured."""
    from engines.contract import SamplingParams
    from retention.rollout.guard import SloBudget
    from server.gateway.admission import LocalAdmission
    from server.gateway.api.completions import CompletionJob, CompletionRunner
    from server.gateway.api.prompting import PreparedPrompt
    from server.gateway.api.streaming import CLIENT_RECEIVE
    from server.gateway.errors import ServingError
    from server.gateway.observe.metrics import GatewayMetrics
    from tenants.snapshots import PoolSnapshot

    pool = PoolSnapshot(id=1, name="gpu-a", model_name="m", triton_model="kvgate_llm", engine_spec="",
                        tokens_per_block=16, primary_blocks=64, secondary_blocks=128, secondary_offload_min_priority=35, replicas=(),
                        slo=SloBudget(ttft_p99_ms=5, window_seconds=60, min_requests=1))
    guards = SloGuards(session_factory=None, pools=lambda: [pool], registry=CollectorRegistry(), clock=Clock())
    runner = CompletionRunner(admission=LocalAdmission(), metrics=GatewayMetrics(CollectorRegistry()),
                              usage=lambda *args: None, guard=guards)
    job = CompletionJob(tenant=_tenant(pool, 7), kind="chat", model="m",
                        prompt=PreparedPrompt(tuple(range(3, 40)), 10, 20), max_new_tokens=4, sampling=SamplingParams(),
                        stop=stop, stream=stream, include_usage=False, tokenizer=TextTokenizer(),  # type: ignore[arg-type]
                        engine=_FailingEngine(exc))  # type: ignore[arg-type]

    async def gone() -> dict:
        await asyncio.sleep(0.02)
        return {"type": "http.disconnect"}

    async def run() -> None:
        token = CLIENT_RECEIVE.set(gone if exc is None else None)
        try:
            with pytest.raises(ServingError):
                await runner.run(job, None)  # type: ignore[arg-type]
        finally:
            CLIENT_RECEIVE.reset(token)

    asyncio.run(run())
    window = guards.view("gpu-a")["window"]
    assert window["ttft_samples"] == (1 if sampled else 0), window
    if sampled:
        assert window["ttft_p99_ms"] >= 20.0, window  # the time it waited: over the 5 ms budget
