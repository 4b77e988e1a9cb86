"""Registry edges on SQLite and PostgreSQL alike: ids never handed out twice, usage from before
a tenant existed, ids and times no row can hold, updates that change nothing, the replica cap."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from tenants import UsageRow, admin_credentials, audit, keys, pools, record_usage, replicas, retention_classes, tenant
from tenants.errors import Conflict, InvalidField, NotFound, StaleVersion
from tenants.models import AuditEvent, Tenant, Usage, UsageFlush
from tenants.usage import usage_report
from tests.tenants.factories import ACTOR, make_class, make_placement, make_pool, make_tenant, now

PEPPER = "pepper-for-tests-0123456789abcdef"


def _events(session, entity_type: str, entity_id: int) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    page = audit.list_events(session, entity_type=entity_type, entity_id=str(entity_id))
    return [(e.action, (e.after or e.before)["slug" if entity_type == "tenant" else "prefix"]) for e in page.items]


# --- ids -----------------------------------------------------------------------------------------


def test_a_deleted_newest_tenants_and_keys_ids_are_not_handed_out_again(session) -> None:  # type: ignore[no-untyped-def]
    """SQLite without AUTOINCREMENT gave the next tenant (and key) the deleted newest one's id:
    its late usage was billed to the newcomer and ``audit tenant/<id>`` mixed the two."""
    make_placement(session)
    bravo = make_tenant(session, "bravo")
    bravo_key, _ = keys.create_key(session, actor=ACTOR, now=now(), tenant="bravo", pepper=PEPPER)
    bravo_id, bravo_key_id, bravo_prefix = bravo.id, bravo_key.id, bravo_key.prefix
    tenant.delete_tenant(session, actor=ACTOR, now=now(), ref="bravo")
    charlie = make_tenant(session, "charlie")
    charlie_key, _ = keys.create_key(session, actor=ACTOR, now=now(), tenant="charlie", pepper=PEPPER)
    assert charlie.id > bravo_id and charlie_key.id > bravo_key_id
    # A late batch of bravo's is not billed to anyone.
    assert record_usage(session, flush_id="late", rows=[UsageRow(bravo_id, now(), 1, 5000, 700)])
    totals, _ = usage_report(session, tenant="charlie")
    assert (totals.requests, totals.prompt_tokens) == (0, 0)
    assert _events(session, "tenant", bravo_id) == [("tenant.delete", "bravo"), ("tenant.create", "bravo")]
    assert [a for a, _ in _events(session, "api_key", bravo_key_id)] == ["api_key.delete", "api_key.create"]
    assert {p for _, p in _events(session, "api_key", bravo_key_id)} == {bravo_prefix}


def test_usage_of_a_minute_before_the_tenant_existed_is_dropped(session) -> None:  # type: ignore[no-untyped-def]
    """A row counted well before the tenant was created belongs to an earlier holder of its id
    (a registry restored from an older copy): it is not billed; its creation minute is, and so is
    a minute within the clock-skew tolerance before it (the gateway's clock may run behind)."""
    from tenants.usage import CLOCK_SKEW_TOLERANCE

    t = make_placement(session)
    created = t.created_at.replace(second=0, microsecond=0)
    rows = [UsageRow(t.id, created - CLOCK_SKEW_TOLERANCE - timedelta(minutes=1), 1, 100, 10),
            UsageRow(t.id, created - timedelta(days=3), 1, 100, 10),
            UsageRow(t.id, created + timedelta(seconds=1), 2, 20, 2)]
    assert record_usage(session, flush_id="f", rows=rows)
    assert [(u.minute, u.requests) for u in session.scalars(select(Usage))] == [(created, 2)]
    flush = session.get(UsageFlush, "f")
    assert (flush.row_count, flush.tenant_id) == (1, t.id)


@pytest.mark.parametrize("bad_id", [2**31, 2**63, 2**64, 0, -1])
def test_key_and_credential_ids_no_row_can_have_are_not_found(session, bad_id: int) -> None:  # type: ignore[no-untyped-def]
    """As get_by_ref does: never an OverflowError (SQLite) or an out-of-range error (PostgreSQL)."""
    make_placement(session)
    with pytest.raises(NotFound) as err:
        keys.revoke_key(session, actor=ACTOR, now=now(), tenant="acme", key_id=bad_id)
    assert err.value.code == "api_key_not_found"
    for call in (lambda: admin_credentials.get_credential(session, credential_id=bad_id),
                 lambda: admin_credentials.revoke_credential(session, actor=ACTOR, now=now(), credential_id=bad_id),
                 lambda: admin_credentials.rotate_credential(session, actor=ACTOR, now=now(), credential_id=bad_id,
                                                             overlap_seconds=0, pepper=PEPPER)):
        with pytest.raises(NotFound) as err:
            call()
        assert err.value.code == "admin_credential_not_found"


def test_usage_rows_of_ids_no_tenant_can_have_are_skipped(session) -> None:  # type: ignore[no-untyped-def]
    t = make_placement(session)
    assert record_usage(session, flush_id="f", rows=[UsageRow(2**31, now(), 1, 1, 1), UsageRow(t.id, now(), 1, 1, 1)])
    assert session.scalar(select(func.sum(Usage.requests))) == 1


# --- times and texts no stored value can hold -----------------------------------------------------

LATE = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5)))  # after UTC's last year
EARLY = datetime(1, 1, 1, 0, 0, 0, tzinfo=timezone(timedelta(hours=5)))  # before UTC's first year


@pytest.mark.parametrize("field", ["since", "until"])
@pytest.mark.parametrize("moment", [LATE, EARLY], ids=["late", "early"])
def test_audit_times_utc_cannot_hold_name_their_filter(session, field: str, moment: datetime) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InvalidField) as err:
        audit.list_events(session, **{field: moment})
    assert err.value.field == field


@pytest.mark.parametrize("field", ["entity_type", "entity_id", "action", "actor"])
def test_audit_text_filters_with_nul_are_refused_on_every_backend(session, field: str) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InvalidField) as err:
        audit.list_events(session, **{field: "tenant\x00"})
    assert err.value.field == field
    assert audit.list_events(session, **{field: "no-such-thing"}).total == 0  # an ordinary miss is an empty page


@pytest.mark.parametrize("field", ["start", "end"])
@pytest.mark.parametrize("moment", [LATE, EARLY], ids=["late", "early"])
def test_usage_times_utc_cannot_hold_name_their_bound(session, field: str, moment: datetime) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InvalidField) as err:
        usage_report(session, tenant="acme", **{field: moment})
    assert err.value.field == field


# --- updates that change nothing, the replica cap --------------------------------------------------


def test_an_update_naming_no_field_writes_nothing(session) -> None:  # type: ignore[no-untyped-def]
    """A PATCH carrying only its version: no version bump, no empty audit event, the row back."""
    t = make_placement(session)
    baseline = session.scalar(select(func.count()).select_from(AuditEvent))
    same = tenant.update_tenant(session, actor=ACTOR, now=now(), ref="acme", version=1, changes={})
    assert same.id == t.id and same.version == 1
    assert pools.update_pool(session, actor=ACTOR, now=now(), ref="gpu-a", version=1, changes={}).version == 1
    assert retention_classes.update_class(session, actor=ACTOR, now=now(), ref="gold", version=1,
                                          changes={}).version == 1
    assert replicas.update_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r0", version=1,
                                   changes={}).version == 1
    assert session.scalar(select(func.count()).select_from(AuditEvent)) == baseline
    session.expire_all()
    assert session.get(Tenant, t.id).version == 1
    with pytest.raises(StaleVersion):  # a stale version is still refused
        tenant.update_tenant(session, actor=ACTOR, now=now(), ref="acme", version=7, changes={})


def test_a_pool_takes_at_most_max_replicas(session) -> None:  # type: ignore[no-untyped-def]
    cap = replicas.MAX_REPLICAS
    assert pools.MAX_REPLICAS == cap  # one definition, at creation and after
    make_pool(session, replicas=[{"name": f"r{i}", "endpoint": f"10.0.{i // 250}.{i % 250 + 1}:8001"}
                                 for i in range(cap - 1)])
    replicas.add_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="last", endpoint="10.9.9.9:8001")
    with pytest.raises(Conflict) as err:
        replicas.add_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="one-more", endpoint="10.9.9.8:8001")
    assert err.value.code == "too_many_replicas"
    assert len(replicas.list_replicas(session, pool="gpu-a")) == cap


def test_ids_still_start_at_one_on_an_empty_registry(session) -> None:  # type: ignore[no-untyped-def]
    """AUTOINCREMENT changes no id of an empty registry (and the fixtures restart ids on both backends)."""
    make_class(session)
    first = make_pool(session)
    assert first.id == 1 and make_tenant(session, pool="gpu-a").id == 1
