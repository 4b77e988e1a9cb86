"""Pool SLO budgets against a real registry (SQLite and PostgreSQL): set, replace, validate,
delete with the pool, audit, and the gateway's snapshot."""

from __future__ import annotations

import pytest
from sqlalchemy import select, text

from retention.rollout.guard import SloBudget
from tenants import list_pool_snapshots, pools, slo
from tenants.errors import InvalidField, NotFound, StaleVersion
from tenants.models import AuditEvent, PoolSloBudget
from tests.tenants.factories import ACTOR, make_pool, now


def test_set_replace_snapshot_and_audit(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    assert list_pool_snapshots(session)[0].slo is None
    with pytest.raises(NotFound) as err:
        slo.get_budget(session, pool="gpu-a")
    assert err.value.code == "slo_budget_not_found"
    row = slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                         values={"ttft_p99_ms": 800, "window_seconds": 30, "min_requests": 10})
    assert (row.ttft_p99_ms, row.itl_p99_ms, row.window_seconds, row.cooldown_seconds, row.hysteresis,
            row.enabled, row.pilot_fraction, row.version) == (800, None, 30, 300, 0.2, True, 1.0, 1)
    (snap,) = list_pool_snapshots(session)
    assert snap.slo == SloBudget(ttft_p99_ms=800, window_seconds=30, min_requests=10, cooldown_seconds=300)
    # A replacement sets every field (defaults for the rest) and bumps the version.
    row = slo.set_budget(session, actor=ACTOR, now=now(), pool=pool.id, values={"itl_p99_ms": 60, "pilot_fraction": 0.5},
                         version=1)
    assert (row.ttft_p99_ms, row.itl_p99_ms, row.pilot_fraction, row.version) == (None, 60, 0.5, 2)
    with pytest.raises(StaleVersion):
        slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={}, version=1)
    events = session.scalars(select(AuditEvent).where(AuditEvent.entity_type == "pool_slo").order_by(AuditEvent.id)).all()
    assert [(e.action, e.entity_id) for e in events] == [("pool_slo.create", str(pool.id)), ("pool_slo.update", str(pool.id))]
    assert events[1].before["ttft_p99_ms"] == 800 and events[1].after["itl_p99_ms"] == 60
    slo.delete_budget(session, actor=ACTOR, now=now(), pool="gpu-a")
    assert list_pool_snapshots(session)[0].slo is None


@pytest.mark.parametrize(("values", "field"), [
    ({"ttft_p99_ms": 0}, "ttft_p99_ms"), ({"window_seconds": 0}, "window_seconds"),
    ({"window_seconds": 1.5}, "window_seconds"), ({"min_requests": 0}, "min_requests"),
    ({"cooldown_seconds": -1}, "cooldown_seconds"), ({"hysteresis": 1}, "hysteresis"),
    ({"pilot_fraction": 2.0}, "pilot_fraction"), ({"enabled": "yes"}, "enabled"), ({"budget": 1}, "budget"),
    ({"window_seconds": 10**9}, "window_seconds"),
    # INTEGER columns: past these bounds a value would be stored on SQLite and fail on PostgreSQL.
    ({"ttft_p99_ms": 3_000_000_000}, "ttft_p99_ms"), ({"itl_p99_ms": 3_600_001}, "itl_p99_ms"),
    ({"min_requests": 3_000_000_000}, "min_requests"), ({"min_requests": 1_000_001}, "min_requests"),
])
def test_bad_values_name_the_field_and_write_nothing(session, values, field) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    with pytest.raises(InvalidField) as err:
        slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values=values)
    assert err.value.field == field
    assert session.scalar(select(PoolSloBudget)) is None


def test_the_bounds_are_the_admin_apis_and_are_storable(session) -> None:  # type: ignore[no-untyped-def]
    """The service, the admin API's schema and the registry file share one set of bounds;
    a budget at the bounds is stored and read back on every backend."""
    from server.admin.slo import SloBudgetSet

    schema = SloBudgetSet.model_json_schema()["properties"]
    assert schema["min_requests"]["maximum"] == slo.MAX_MIN_REQUESTS
    assert {s.get("maximum") for s in schema["ttft_p99_ms"]["anyOf"]} >= {slo.MAX_BUDGET_MS}
    make_pool(session)
    top = {"ttft_p99_ms": slo.MAX_BUDGET_MS, "itl_p99_ms": slo.MAX_BUDGET_MS, "min_requests": slo.MAX_MIN_REQUESTS,
           "window_seconds": slo.MAX_SECONDS, "cooldown_seconds": slo.MAX_SECONDS}
    row = slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values=top)
    session.expire_all()
    assert {k: getattr(slo.get_budget(session, pool="gpu-a"), k) for k in top} == top and row.version == 1


def test_the_database_refuses_what_the_service_refuses(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"ttft_p99_ms": 500})
    with pytest.raises(Exception):
        session.execute(text(f"UPDATE pool_slo_budgets SET hysteresis = 1.5 WHERE pool_id = {pool.id}"))
        session.commit()
    session.rollback()


def test_budget_goes_with_its_pool(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a", values={"ttft_p99_ms": 500})
    pools.delete_pool(session, actor=ACTOR, now=now(), ref="gpu-a")
    assert session.scalar(select(PoolSloBudget)) is None


def test_guard_events_are_audited(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    slo.record_guard_event(session, actor="gateway:slo-guard", now=now(), pool_id=pool.id, action="trip",
                           before={"tripped": False}, after={"tripped": True, "reason": "r"})
    (event,) = session.scalars(select(AuditEvent).where(AuditEvent.action == "pool_slo.trip")).all()
    assert event.actor == "gateway:slo-guard" and event.after["tripped"] is True


def test_min_requests_is_bounded_by_the_samples_the_guard_keeps(session) -> None:  # type: ignore[no-untyped-def]
    """A budget needing more samples than the guard's window keeps could never trip: the service,
    the admin API and the registry file refuse it (one bound: the guard's)."""
    import copy

    from retention.rollout import guard
    from tenants import declarative
    from tests.tenants.test_declarative import ACTOR as FILE_ACTOR, FILE

    make_pool(session)
    with pytest.raises(InvalidField) as err:
        slo.set_budget(session, actor=ACTOR, now=now(), pool="gpu-a",
                       values={"ttft_p99_ms": 500, "min_requests": guard.DEFAULT_MAX_OBSERVATIONS + 1})
    assert err.value.field == "min_requests"
    doc = copy.deepcopy(FILE)
    doc["pools"][0]["slo"] = {"ttft_p99_ms": 500, "min_requests": guard.DEFAULT_MAX_OBSERVATIONS + 1}
    with pytest.raises(InvalidField) as err:
        declarative.apply_registry(session, declarative.parse_registry(doc), actor=FILE_ACTOR, now=now())
    assert err.value.field == "pools[0].slo.min_requests"
    assert slo.MAX_MIN_REQUESTS == guard.MAX_MIN_REQUESTS == guard.DEFAULT_MAX_OBSERVATIONS
