"""Deleting a pool audits what its cascade deletes: each trace capture and its SLO budget.

The FK ``CASCADE`` takes the pool's replicas, budget and captures with it; the audit log
says so in the same transaction — one ``trace_capture.delete`` per capture (an active one
too, as ``delete_tenant`` records them), one ``pool_slo.delete`` when a budget existed (as
``slo.delete_budget`` records it), then ``pool.delete`` — or, when the delete fails, none.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from tenants import audit, captures, pools, slo, tenant
from tenants.models import AuditEvent, Pool, PoolSloBudget, TraceCapture
from tests.tenants.factories import ACTOR, make_class, make_pool, make_tenant, now

DELETER = "test:deleter"


def _events(session, actor: str = DELETER) -> list[AuditEvent]:  # type: ignore[no-untyped-def]
    return list(session.scalars(select(AuditEvent).where(AuditEvent.actor == actor).order_by(AuditEvent.id)))


def _created(session, entity_type: str, entity_id: int) -> AuditEvent:  # type: ignore[no-untyped-def]
    return session.scalars(select(AuditEvent).where(
        AuditEvent.entity_type == entity_type, AuditEvent.entity_id == str(entity_id),
        AuditEvent.action == f"{entity_type}.create")).one()


def test_a_pools_captures_and_budget_each_get_a_delete_event(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    other = make_pool(session, "gpu-b")
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"ttft_p99_ms": 500})
    stopped = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-a", sample_rate=0.5)
    captures.stop_capture(session, actor=ACTOR, now=now(), pool="gpu-a", capture_id=stopped.id)
    active = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-a")
    elsewhere = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-b")
    pool_id, stopped_id, active_id = pool.id, stopped.id, active.id

    pools.delete_pool(session, actor=DELETER, now=now(), ref="gpu-a")

    events = _events(session)
    assert [(e.action, e.entity_type, e.entity_id) for e in events] == [
        ("trace_capture.delete", "trace_capture", str(stopped_id)),
        ("trace_capture.delete", "trace_capture", str(active_id)),
        (f"{slo.ENTITY}.delete", slo.ENTITY, str(pool_id)),
        ("pool.delete", "pool", str(pool_id)),
    ]
    assert len({e.at for e in events}) == 1 and all(e.after is None for e in events)
    dropped_stopped, dropped_active, budget, _ = events
    assert (dropped_stopped.before["state"], dropped_stopped.before["sample_rate"]) == ("stopped", 0.5)
    assert dropped_active.before["state"] == "active" and dropped_active.before["stopped_at"] is None
    for event in (dropped_stopped, dropped_active):  # the capture's view, never its key
        assert "key" not in event.before
        assert set(event.before) == set(_created(session, "trace_capture", int(event.entity_id)).after)
    # the budget as it stood: what delete_budget would have recorded
    assert budget.before == _created(session, slo.ENTITY, pool_id).after and budget.before["ttft_p99_ms"] == 500
    assert session.scalar(select(func.count()).select_from(TraceCapture).where(TraceCapture.pool_id == pool_id)) == 0
    assert session.scalar(select(func.count()).select_from(PoolSloBudget)) == 0
    # another pool's capture is untouched and unmentioned
    assert session.get(TraceCapture, elsewhere.id).state == "active" and session.get(Pool, other.id) is not None
    assert not any(e.entity_id == str(elsewhere.id) for e in events)


def test_a_bare_pool_is_one_event(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    pools.delete_pool(session, actor=DELETER, now=now(), ref=pool.id)
    assert [(e.action, e.entity_id) for e in _events(session)] == [("pool.delete", str(pool.id))]


def test_the_events_match_delete_tenants_and_delete_budgets(session) -> None:  # type: ignore[no-untyped-def]
    """The same event shapes whichever path deletes a capture or a budget."""
    make_pool(session)
    make_pool(session, "gpu-b")
    make_class(session)
    make_tenant(session, "acme", pool="gpu-a")
    by_tenant = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-a", tenant="acme")
    tenant.delete_tenant(session, actor="test:tenant", now=now(), ref="acme")
    (tenant_capture,) = [e for e in _events(session, "test:tenant") if e.entity_type == "trace_capture"]
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-b", values={"itl_p99_ms": 80})
    slo.delete_budget(session, actor="test:budget", now=now(), pool="gpu-b")
    (budget_delete,) = _events(session, "test:budget")

    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"itl_p99_ms": 80})
    by_pool = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-a")
    pools.delete_pool(session, actor=DELETER, now=now(), ref="gpu-a")
    capture_event, budget_event, _ = _events(session)
    assert (capture_event.action, capture_event.entity_type, capture_event.entity_id) == (
        tenant_capture.action, tenant_capture.entity_type, str(by_pool.id))
    assert set(capture_event.before) == set(tenant_capture.before) and tenant_capture.entity_id == str(by_tenant.id)
    assert (budget_event.action, budget_event.entity_type) == (budget_delete.action, budget_delete.entity_type)
    strip = {"id", "pool_id", "created_at", "updated_at"}
    assert {k: v for k, v in budget_event.before.items() if k not in strip} == \
        {k: v for k, v in budget_delete.before.items() if k not in strip}


def test_a_failed_delete_records_nothing_and_keeps_all(session, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One transaction: when the pool's own delete fails, its captures' and budget's events roll back with it."""
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"ttft_p99_ms": 500})
    cap = captures.start_capture(session, actor=ACTOR, now=now(), pool="gpu-a")

    def broken(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the pool's delete failed")

    monkeypatch.setattr(audit, "audited_delete", broken)
    with pytest.raises(RuntimeError):
        pools.delete_pool(session, actor=DELETER, now=now(), ref="gpu-a")
    assert _events(session) == []
    assert session.get(TraceCapture, cap.id).state == "active" and session.scalar(select(PoolSloBudget)) is not None
