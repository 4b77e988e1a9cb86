"""Concurrency under real contention: two sessions in two threads, on SQLite and PostgreSQL.

A barrier inside SQLAlchemy's ``before_cursor_execute`` holds each thread right before
a chosen statement until both have reached it: two updates of one version (only the
database-level ``WHERE version = ?`` can decide), a dedicated tenant and another placed
on one empty pool at once, two stores of one tenant with room for one under its byte cap.
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event, func, select

from tenants import tenant
from tenants.errors import Conflict, StaleVersion
from tenants.models import AuditEvent, Pool, Tenant
from tests.tenants.factories import make_placement, now


@pytest.mark.parametrize("round_", range(3))
def test_exactly_one_of_two_concurrent_updates_wins(db, round_: int) -> None:  # type: ignore[no-untyped-def]
    with db.factory() as s:
        t = make_placement(s)
        baseline = s.scalar(select(func.count()).select_from(AuditEvent))
    hook = _hold_both_before(db, lambda statement, _backend: statement.lstrip().upper().startswith("UPDATE TENANTS"))

    def update(name: str, rpm: int):  # type: ignore[no-untyped-def]
        return lambda s: tenant.update_tenant(s, actor=f"test:{name}", now=now(), ref=t.id, version=1,
                                              changes={"rpm_limit": rpm, "display_name": name}).version

    outcomes = _run_workers(db, hook, {"left": update("left", 11), "right": update("right", 22)})
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


def _hold_both_before(db, is_hold_point):  # type: ignore[no-untyped-def]
    """A ``before_cursor_execute`` hook holding each worker thread at its first statement that
    ``is_hold_point(statement, backend)`` until the other one reaches its own (or 10 s pass,
    as when the fix makes one wait on a lock the other holds)."""
    barrier = threading.Barrier(2, timeout=10)
    held = threading.local()

    def hook(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("worker") and not getattr(held, "done", False) \
                and is_hold_point(statement, db.backend):
            held.done = True
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

    return hook


def _run_workers(db, hook, jobs) -> dict[str, object]:  # type: ignore[no-untyped-def]
    outcomes: dict[str, object] = {}

    def run(name: str, job) -> None:  # type: ignore[no-untyped-def]
        try:
            with db.factory() as s:
                outcomes[name] = job(s)
        except Exception as exc:  # noqa: BLE001 - asserted by the caller
            outcomes[name] = exc

    event.listen(db.engine, "before_cursor_execute", hook)
    threads = [threading.Thread(target=run, args=(name, job), name=f"worker-{name}") for name, job in jobs.items()]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        event.remove(db.engine, "before_cursor_execute", hook)
    return outcomes


def _placement_write(statement: str, backend: str) -> bool:
    """The first write (or, once fixed on PostgreSQL, the pool lock) of a tenant placement:
    both requests have read the pool's tenants and passed the service's check before it."""
    text = statement.lstrip().upper()
    return text.startswith(("INSERT INTO TENANTS", "UPDATE TENANTS")) or (
        "FROM POOLS" in text and "FOR UPDATE" in text)


@pytest.mark.parametrize("other", ["create", "move"])
def test_a_dedicated_tenant_and_another_never_share_a_pool(db, other: str) -> None:  # type: ignore[no-untyped-def]
    """A dedicated tenant created while another tenant is created on (or moved to) the same
    empty pool: one of the two is refused; the pool is never dedicated and shared."""
    from tests.tenants.factories import make_class, make_pool, make_tenant

    with db.factory() as s:
        make_pool(s, name="empty")
        make_pool(s, name="elsewhere")
        make_class(s)
        mover = make_tenant(s, "mover", pool="elsewhere")
    jobs = {
        "dedicated": lambda s: make_tenant(s, "secret-co", pool="empty", isolation="dedicated").id,
        "other": (lambda s: make_tenant(s, "other-co", pool="empty").id) if other == "create" else
                 (lambda s: tenant.update_tenant(s, actor="test", now=now(), ref="mover", version=mover.version,
                                                 changes={"pool": "empty"}).id),
    }
    outcomes = _run_workers(db, _hold_both_before(db, _placement_write), jobs)
    refused = [name for name, o in outcomes.items() if isinstance(o, Conflict)]
    assert len(refused) == 1 and all(isinstance(o, int) for n, o in outcomes.items() if n not in refused), outcomes
    assert outcomes[refused[0]].code in ("pool_dedicated", "pool_not_empty")  # type: ignore[union-attr]
    with db.factory() as s:
        on_pool = s.execute(select(Tenant.slug, Tenant.isolation).join(Pool, Pool.id == Tenant.pool_id)
                            .where(Pool.name == "empty")).all()
        assert len(on_pool) == 1, on_pool
        events = s.scalars(select(AuditEvent).where(AuditEvent.action.in_(["tenant.create", "tenant.update"]))).all()
        raced = [e for e in events if (e.after or {}).get("slug") in ("secret-co", "other-co") or e.actor == "test"]
        assert len(raced) == 1, [(e.action, e.after["slug"]) for e in raced]  # the refused one left no event


def _store_check(statement: str, backend: str) -> bool:
    """PostgreSQL: the cap's check (the sum of the tenant's bytes) or, once fixed, the lock
    taken before it. SQLite: the store's first statement (its DELETE takes the write lock)."""
    text = statement.lstrip().lower()
    if backend == "postgresql":
        return "for no key update" in text or "sum(stored_responses.size_bytes)" in text
    return text.startswith("delete from stored_responses")


@pytest.mark.parametrize("round_", range(2))
def test_concurrent_stores_of_a_tenant_never_pass_its_byte_cap(db, round_: int) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from tenants import responses

    with db.factory() as s:
        tid = make_placement(s).id
    body = {"x": "y" * 600}
    size = responses.row_size(input_items=[], output_items=[], body=body)
    cap = size + 100  # room for one

    def store(ident: str):  # type: ignore[no-untyped-def]
        return lambda s: responses.store_response(
            s, tenant_id=tid, response_id=ident, previous_response_id=None, model="m", input_items=[],
            output_items=[], body=body, now=now(), ttl=timedelta(hours=1), max_bytes=cap).id

    outcomes = _run_workers(db, _hold_both_before(db, _store_check), {"a": store("resp_a"), "b": store("resp_b")})
    full = [n for n, o in outcomes.items() if isinstance(o, responses.StoreFull)]
    assert len(full) == 1, outcomes
    with db.factory() as s:
        assert responses.stored_bytes(s, tenant_id=tid, now=now()) == size <= cap
