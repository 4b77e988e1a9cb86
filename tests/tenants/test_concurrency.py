"""Optimistic concurrency under real contention: two sessions in two threads, same version.

A barrier inside SQLAlchemy's ``before_cursor_execute`` holds each thread right before
its ``UPDATE tenants`` until both have read version 1 and passed the service's own
version check, so only the database-level ``WHERE version = ?`` can decide the race.
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event, func, select

from tenants import tenant
from tenants.errors import StaleVersion
from tenants.models import AuditEvent, Tenant
from tests.tenants.factories import make_placement, now


@pytest.mark.parametrize("round_", range(3))
def test_exactly_one_of_two_concurrent_updates_wins(db, round_: int) -> None:  # type: ignore[no-untyped-def]
    with db.factory() as s:
        t = make_placement(s)
        baseline = s.scalar(select(func.count()).select_from(AuditEvent))
    barrier = threading.Barrier(2, timeout=20)

    def hold_updates(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE TENANTS"):
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

    event.listen(db.engine, "before_cursor_execute", hold_updates)
    outcomes: dict[str, object] = {}

    def worker(name: str, rpm: int) -> None:
        try:
            with db.factory() as s:
                done = tenant.update_tenant(
                    s,
                    actor=f"test:{name}",
                    now=now(),
                    ref=t.id,
                    version=1,
                    changes={"rpm_limit": rpm, "display_name": name},
                )
                outcomes[name] = done.version
        except StaleVersion as exc:
            outcomes[name] = exc
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            outcomes[name] = exc

    threads = [threading.Thread(target=worker, args=(n, r)) for n, r in (("left", 11), ("right", 22))]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        event.remove(db.engine, "before_cursor_execute", hold_updates)

    winners = [n for n, o in outcomes.items() if o == 2]
    losers = [n for n, o in outcomes.items() if isinstance(o, StaleVersion)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    with db.factory() as s:
        row = s.get(Tenant, t.id)
        assert row.version == 2
        assert (row.display_name, row.rpm_limit) == (winners[0], 11 if winners[0] == "left" else 22)
        events = s.scalars(select(AuditEvent).where(AuditEvent.id > 0).order_by(AuditEvent.id)).all()
        assert len(events) == baseline + 1
        assert events[-1].action == "tenant.update" and events[-1].actor == f"test:{winners[0]}"
