"""Usage batches are applied at most once, even on retry or concurrent duplicate flushes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from tenants import UsageRow, record_usage, tenant
from tenants.errors import InvalidField
from tenants.models import Usage, UsageFlush
from tenants.usage import usage_report
from tests.tenants.factories import ACTOR, make_placement, make_tenant, now

# After the tenants' creation: a row of a minute before its tenant was created is dropped.
T0 = (datetime.now(UTC) + timedelta(days=1)).replace(second=0, microsecond=0)


def test_batch_applies_once_and_merges_minutes(session) -> None:  # type: ignore[no-untyped-def]
    t = make_placement(session)
    rows = [
        UsageRow(t.id, T0 + timedelta(seconds=5), 1, 10, 3),
        UsageRow(t.id, T0 + timedelta(seconds=50), 2, 20, 4),
        UsageRow(t.id, T0 + timedelta(minutes=1), 1, 1, 1),
    ]
    assert record_usage(session, flush_id="gw1-0001", rows=rows) is True
    assert record_usage(session, flush_id="gw1-0001", rows=rows) is False  # retry after a "crash"
    assert record_usage(session, flush_id="gw1-0002", rows=rows[:1]) is True
    totals, page = usage_report(session, tenant="acme")
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens) == (5, 41, 11)
    assert [(u.minute, u.requests, u.prompt_tokens) for u in page.items] == [
        (T0, 4, 40),
        (T0 + timedelta(minutes=1), 1, 1),
    ]
    totals, page = usage_report(session, tenant="acme", start=T0 + timedelta(minutes=1))
    assert (totals.requests, page.total) == (1, 1)
    totals, _ = usage_report(session, tenant="acme", end=T0 + timedelta(minutes=1))
    assert totals.requests == 4


def test_rows_of_deleted_tenants_are_skipped(session) -> None:  # type: ignore[no-untyped-def]
    t = make_placement(session)
    gone = make_tenant(session, "gone")
    tenant.delete_tenant(session, actor=ACTOR, now=now(), ref="gone")
    assert record_usage(session, flush_id="f", rows=[UsageRow(t.id, T0, 1, 1, 1), UsageRow(gone.id, T0, 9, 9, 9)])
    assert session.scalar(select(func.sum(Usage.requests))) == 1
    assert session.get(UsageFlush, "f").row_count == 1


@pytest.mark.parametrize("bad", [UsageRow(1, T0, -1, 0, 0), UsageRow(1, datetime(2026, 1, 1), 1, 1, 1)])
def test_invalid_rows_are_refused_before_any_write(session, bad: UsageRow) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InvalidField):
        record_usage(session, flush_id="bad", rows=[bad])
    assert session.get(UsageFlush, "bad") is None


def test_concurrent_duplicate_flush_counts_once(db) -> None:  # type: ignore[no-untyped-def]
    with db.factory() as s:
        t = make_placement(s)
    results: list[object] = []
    barrier = threading.Barrier(4, timeout=20)

    def flush() -> None:
        barrier.wait()
        try:
            with db.factory() as s:
                results.append(record_usage(s, flush_id="dup", rows=[UsageRow(t.id, T0, 1, 100, 10)]))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results.append(exc)

    threads = [threading.Thread(target=flush) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert sorted(results, key=str) == [False, False, False, True], results
    with db.factory() as s:
        assert s.scalar(select(func.sum(Usage.prompt_tokens))) == 100
