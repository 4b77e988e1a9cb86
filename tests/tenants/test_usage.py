"""Usage batches are applied at most once, even on retry or concurrent duplicate flushes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from tenants import UsageRow, record_usage, tenant
from tenants.errors import InvalidField
from tenants.models import Usage, UsageFlush
from tenants.usage import CLOCK_SKEW_TOLERANCE, UsageApplied, apply_usage, usage_report
from tests.tenants.factories import ACTOR, make_class, make_placement, make_pool, make_tenant, now

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


def _requests(session, **window) -> int:  # type: ignore[no-untyped-def]
    return usage_report(session, tenant="acme", **window)[0].requests


def test_windows_are_half_open_on_minute_buckets(session) -> None:  # type: ignore[no-untyped-def]
    t = make_placement(session)
    record_usage(session, flush_id="f", rows=[UsageRow(t.id, T0 + timedelta(seconds=10), 1, 100, 10),
                                              UsageRow(t.id, T0 + timedelta(seconds=50), 1, 100, 10),
                                              UsageRow(t.id, T0 + timedelta(minutes=1), 1, 1, 1)])
    before, after = T0 - timedelta(hours=1), T0 + timedelta(hours=1)
    assert _requests(session, start=before, end=after) == 3
    for cut in (T0 + timedelta(seconds=30), T0 + timedelta(microseconds=1), T0 + timedelta(seconds=59),
                T0, T0 + timedelta(minutes=1)):
        halves = _requests(session, start=before, end=cut), _requests(session, start=cut, end=after)
        assert sum(halves) == 3, (cut, halves)  # each minute in exactly one of two adjacent windows
        assert _requests(session, start=cut, end=cut) == 0  # [x, x) is empty
    # a minute is in the window iff its start is: T0's minute starts before T0+30s, T0+1min's after
    assert _requests(session, start=before, end=T0 + timedelta(seconds=30)) == 2
    assert _requests(session, start=T0 + timedelta(seconds=30), end=T0 + timedelta(minutes=1, seconds=30)) == 1
    # a bound in another offset is the same instant
    tz = timezone(timedelta(hours=5, minutes=30))
    assert _requests(session, start=(T0 + timedelta(seconds=30)).astimezone(tz)) == 1
    # the ends of time: no minute starts after 9999-12-31T23:59:30Z, every minute before it
    end_of_time = datetime(9999, 12, 31, 23, 59, 30, tzinfo=UTC)
    assert _requests(session, start=end_of_time) == 0 and _requests(session, end=end_of_time) == 3


def test_a_gateway_clock_behind_the_admin_server_still_bills_a_new_tenant(session, caplog) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    make_class(session)
    created = (datetime.now(UTC) + timedelta(minutes=30)).replace(second=0, microsecond=300_000)
    t = tenant.create_tenant(session, actor=ACTOR, now=created, slug="acme", display_name="A", pool="gpu-a",
                             retention_class="gold")
    # answered 0.5 s after the creation by a gateway 1 s behind: its minute is the one before
    behind = created + timedelta(seconds=0.5) - timedelta(seconds=1)
    applied = apply_usage(session, flush_id="skew", rows=[UsageRow(t.id, behind, 1, 1000, 200)])
    assert applied == UsageApplied(True, written=1)
    assert _requests(session) == 1 and session.get(UsageFlush, "skew").row_count == 1
    # within the tolerance: counted; beyond it: dropped, logged, and said so
    edge = created.replace(microsecond=0) - CLOCK_SKEW_TOLERANCE
    with caplog.at_level("WARNING", logger="kvgate.tenants.usage"):
        applied = apply_usage(session, flush_id="far", rows=[UsageRow(t.id, edge, 1, 1, 1),
                                                             UsageRow(t.id, edge - timedelta(seconds=1), 1, 1, 1),
                                                             UsageRow(t.id + 1000, edge, 1, 1, 1)])
    assert applied == UsageApplied(True, written=1, dropped_unknown_tenant=1, dropped_before_creation=1)
    assert applied.dropped == 2 and session.get(UsageFlush, "far").row_count == 1
    assert any("1 row(s) dropped" in r.getMessage() and "far" in r.getMessage() for r in caplog.records)
    assert _requests(session) == 2
    assert apply_usage(session, flush_id="far", rows=[]) == UsageApplied(False)  # applied before: nothing now


def test_cache_counters_are_summed_applied_once_and_reported(session) -> None:  # type: ignore[no-untyped-def]
    """The three cache counters take the same path as the others: merged per minute, added to a
    minute already counted (the upsert's conflict branch), applied once, summed by the report.
    BIGINT: a count past INT32 round-trips."""
    t = make_placement(session)
    big = 2**40
    first = [UsageRow(t.id, T0 + timedelta(seconds=5), 1, 100, 3, cache_read_tokens=64, cache_write_5m_tokens=32),
             UsageRow(t.id, T0 + timedelta(seconds=40), 1, 100, 4, cache_read_tokens=48, cache_write_1h_tokens=48),
             UsageRow(t.id, T0 + timedelta(minutes=1), 1, 3 * big, 1, big, big, big)]
    assert record_usage(session, flush_id="c1", rows=first)
    assert not record_usage(session, flush_id="c1", rows=first)  # a retry adds nothing
    assert record_usage(session, flush_id="c2", rows=[UsageRow(t.id, T0, 1, 50, 1, 16, 16, 16)])  # same minute
    totals, page = usage_report(session, tenant="acme")
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens) == (4, 250 + 3 * big, 9)
    assert (totals.cache_read_tokens, totals.cache_write_5m_tokens, totals.cache_write_1h_tokens) == \
        (128 + big, 48 + big, 64 + big)
    assert [(u.minute, u.requests, u.cache_read_tokens, u.cache_write_5m_tokens, u.cache_write_1h_tokens)
            for u in page.items] == [(T0, 3, 128, 48, 64), (T0 + timedelta(minutes=1), 1, big, big, big)]
    totals, _ = usage_report(session, tenant="acme", start=T0 + timedelta(minutes=1))
    assert (totals.cache_read_tokens, totals.cache_write_5m_tokens, totals.cache_write_1h_tokens) == (big, big, big)
    # rows without them (as every caller wrote before) count 0, and a negative one is refused before any write
    assert record_usage(session, flush_id="c3", rows=[UsageRow(t.id, T0, 1, 10, 1)])
    assert usage_report(session, tenant="acme")[0].cache_read_tokens == 128 + big
    with pytest.raises(InvalidField):
        record_usage(session, flush_id="c4", rows=[UsageRow(t.id, T0, 1, 10, 1, cache_write_1h_tokens=-1)])
    assert session.get(UsageFlush, "c4") is None
