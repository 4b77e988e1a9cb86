"""`registry.yaml` pools may carry their SLO budget (`slo:`): planned, applied, audited,
idempotent; a bad budget is refused with its path; omitted means not managed, `slo: null`
means no budget."""

from __future__ import annotations

import copy

import pytest
from sqlalchemy import select

from tenants import declarative, slo
from tenants.errors import InvalidField, NotFound
from tenants.models import AuditEvent
from tests.tenants.factories import now
from tests.tenants.test_declarative import ACTOR, FILE


def _apply(session, doc, **kw):  # type: ignore[no-untyped-def]
    return declarative.apply_registry(session, declarative.parse_registry(doc), actor=ACTOR, now=now(), **kw)


def test_budget_from_the_file(session) -> None:  # type: ignore[no-untyped-def]
    doc = copy.deepcopy(FILE)
    doc["pools"][0]["slo"] = {"ttft_p99_ms": 800, "window_seconds": 30}
    plan = _apply(session, doc)
    assert ("pool_slo", "create", "llama8b") in [(c.kind, c.action, c.ref) for c in plan.changes]
    row = slo.get_budget(session, pool="llama8b")
    assert (row.ttft_p99_ms, row.window_seconds, row.min_requests, row.version) == (800, 30, 20, 1)
    assert _apply(session, doc).empty  # applied again: nothing to do
    doc["pools"][0]["slo"] = {"ttft_p99_ms": 800, "window_seconds": 30, "pilot_fraction": 0.25}
    plan = _apply(session, doc)
    (change,) = plan.changes
    assert (change.kind, change.action) == ("pool_slo", "update")
    assert [(f.name, f.old, f.new) for f in change.fields] == [("pilot_fraction", 1.0, 0.25)]
    assert slo.get_budget(session, pool="llama8b").pilot_fraction == 0.25
    actions = session.scalars(select(AuditEvent.action).where(AuditEvent.entity_type == "pool_slo")).all()
    assert sorted(actions) == ["pool_slo.create", "pool_slo.update"]
    del doc["pools"][0]["slo"]
    assert _apply(session, doc).empty  # omitted: not managed, the budget stays
    assert slo.get_budget(session, pool="llama8b").pilot_fraction == 0.25


@pytest.mark.parametrize(("budget", "field"), [
    ({"hysteresis": 1.0}, "pools[0].slo"), ({"budget": 1}, "pools[0].slo.budget"),
    # The admin API's bounds hold for the file too (INTEGER columns; PostgreSQL refused 3e9 at write time).
    ({"ttft_p99_ms": 3_000_000_000}, "pools[0].slo.ttft_p99_ms"),
    ({"min_requests": 3_000_000_000}, "pools[0].slo.min_requests"),
])
def test_bad_budget_names_its_path(session, budget, field) -> None:  # type: ignore[no-untyped-def]
    doc = copy.deepcopy(FILE)
    doc["pools"][0]["slo"] = budget
    with pytest.raises(InvalidField) as err:
        _apply(session, doc)
    assert err.value.field.startswith(field)
    assert session.scalar(select(AuditEvent.id)) is None  # nothing written


def test_slo_null_deletes_the_budget_and_an_omitted_slo_keeps_it(session) -> None:  # type: ignore[no-untyped-def]
    """``slo: null`` says the pool has no budget: one audited ``pool_slo`` delete, with or without
    --prune. An omitted ``slo`` is not managed, even with --prune (a budget set with
    ``kvgate admin slo set`` survives a file that never mentions budgets)."""
    doc = copy.deepcopy(FILE)
    doc["pools"][0]["slo"] = {"ttft_p99_ms": 800}
    _apply(session, doc)
    del doc["pools"][0]["slo"]
    assert _apply(session, doc, prune=True).empty
    assert slo.get_budget(session, pool="llama8b").ttft_p99_ms == 800

    doc["pools"][0]["slo"] = None
    dry = _apply(session, doc, dry_run=True)
    assert [(c.kind, c.action, c.ref) for c in dry.changes] == [("pool_slo", "delete", "llama8b")]
    assert "- pool_slo llama8b" in dry.render().splitlines() and "    ttft_p99_ms: 800" in dry.render().splitlines()
    assert slo.get_budget(session, pool="llama8b").ttft_p99_ms == 800  # a dry run writes nothing
    plan = _apply(session, doc)
    assert [(c.kind, c.action) for c in plan.changes] == [("pool_slo", "delete")]
    with pytest.raises(NotFound):
        slo.get_budget(session, pool="llama8b")
    (event,) = session.scalars(select(AuditEvent).where(AuditEvent.action == "pool_slo.delete")).all()
    assert (event.actor, event.before["ttft_p99_ms"], event.after) == (ACTOR, 800, None)
    assert _apply(session, doc).empty and _apply(session, doc, prune=True).empty  # nothing left to delete
    # A new pool with `slo: null` gets no budget and no change for it.
    doc["pools"].append({**copy.deepcopy(FILE["pools"][0]), "name": "other", "slo": None})
    assert [(c.kind, c.action, c.ref) for c in _apply(session, doc).changes] == [("pool", "create", "other")]
