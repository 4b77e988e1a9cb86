"""Service functions against a real registry: validation, uniqueness, references, deletion rules."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select

from tenants import pools, retention_classes, tenant
from tenants.errors import Conflict, Duplicate, InUse, InvalidField, NotFound, StaleVersion
from tenants.models import AuditEvent, Tenant
from tests.tenants.factories import ACTOR, make_class, make_placement, make_pool, make_tenant, now


def _events(session) -> int:  # type: ignore[no-untyped-def]
    return session.scalar(select(func.count()).select_from(AuditEvent))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("secondary_offload_min_priority", 101),
        ("secondary_offload_min_priority", -1),
        ("primary_blocks", 0),
        ("secondary_blocks", -5),
        ("tokens_per_block", 0),
        ("model_name", ""),
        ("name", "123"),
        ("name", "Bad Name"),
    ],
)
def test_pool_validation_names_the_field(session, field, value) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(name="ok", model_name="m", triton_url="h:1", primary_blocks=8)
    kwargs[field] = value
    with pytest.raises(InvalidField) as err:
        pools.create_pool(session, actor=ACTOR, now=now(), **kwargs)
    assert err.value.field == field
    assert _events(session) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("system_priority", 101),
        ("context_priority", -1),
        ("turn_duration_ms", -1),
        ("decode_priority", 1.5),
        ("decode_duration_ms", -10),
        ("turn_priority", True),
    ],
)
def test_class_validation_names_the_field(session, field, value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidField) as err:
        retention_classes.create_class(session, actor=ACTOR, now=now(), name="c", **{field: value})
    assert err.value.field == field


def test_duplicate_names_conflict(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    with pytest.raises(Duplicate) as err:
        make_pool(session)
    assert err.value.field == "name"
    make_class(session)
    make_tenant(session)
    with pytest.raises(Duplicate) as err:
        make_tenant(session)
    assert err.value.field == "slug"
    assert _events(session) == 3


def test_unknown_references_are_field_errors(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    make_class(session)
    with pytest.raises(InvalidField) as err:
        make_tenant(session, pool="nope")
    assert (err.value.field, err.value.code) == ("pool", "unknown_pool")
    with pytest.raises(InvalidField) as err:
        make_tenant(session, cls=999)
    assert (err.value.field, err.value.code) == ("retention_class", "unknown_retention_class")
    with pytest.raises(NotFound):
        tenant.get_tenant(session, ref="ghost")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_quota_fraction", 0),
        ("kv_quota_fraction", 1.01),
        ("kv_quota_fraction", float("nan")),
        ("rpm_limit", 0),
        ("isolation", "private"),
        ("max_output_tokens", -1),
    ],
)
def test_tenant_validation(session, field, value) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    make_class(session)
    with pytest.raises(InvalidField) as err:
        make_tenant(session, **{field: value})
    assert err.value.field == field


def test_cache_salt_is_server_generated_and_kept_out_of_audit(session) -> None:  # type: ignore[no-untyped-def]
    a = make_placement(session)
    b = make_tenant(session, "beta")
    assert re.fullmatch(r"[0-9a-f]{32}", a.cache_salt) and a.cache_salt != b.cache_salt
    with pytest.raises(InvalidField) as err:
        tenant.update_tenant(session, actor=ACTOR, now=now(), ref="acme", version=1, changes={"cache_salt": "x" * 32})
    assert err.value.field == "cache_salt"
    for event in session.scalars(select(AuditEvent)):
        assert "cache_salt" not in (event.before or {}) and "cache_salt" not in (event.after or {})
        assert a.cache_salt not in str(event.before) + str(event.after)
    with pytest.raises(TypeError):
        tenant.create_tenant(
            session,
            actor=ACTOR,
            now=now(),
            slug="c",
            display_name="C",
            pool="gpu-a",
            retention_class="gold",
            cache_salt="mine",
        )  # type: ignore[call-arg]


def test_update_bumps_version_and_rejects_stale(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    updated = tenant.update_tenant(
        session, actor=ACTOR, now=now(), ref="acme", version=1, changes={"rpm_limit": 5, "display_name": "ACME"}
    )
    assert (updated.version, updated.rpm_limit, updated.display_name) == (2, 5, "ACME")
    with pytest.raises(StaleVersion):
        tenant.update_tenant(session, actor=ACTOR, now=now(), ref="acme", version=1, changes={"rpm_limit": 6})
    assert session.get(Tenant, updated.id).rpm_limit == 5


def test_in_use_pool_and_class_cannot_be_deleted(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    with pytest.raises(InUse):
        pools.delete_pool(session, actor=ACTOR, now=now(), ref="gpu-a")
    with pytest.raises(InUse):
        retention_classes.delete_class(session, actor=ACTOR, now=now(), ref="gold")
    tenant.delete_tenant(session, actor=ACTOR, now=now(), ref="acme")
    pools.delete_pool(session, actor=ACTOR, now=now(), ref="gpu-a")
    retention_classes.delete_class(session, actor=ACTOR, now=now(), ref="gold")
    assert pools.list_pools(session).total == 0


def test_dedicated_tenant_is_alone_on_its_pool(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    make_pool(session, "gpu-b")
    make_class(session)
    make_tenant(session, "solo", pool="gpu-b", isolation="dedicated")
    with pytest.raises(Conflict) as err:
        make_tenant(session, "intruder", pool="gpu-b")
    assert err.value.code == "pool_dedicated"
    make_tenant(session, "shared1", pool="gpu-a", isolation="shared")
    with pytest.raises(Conflict) as err:
        make_tenant(session, "solo2", pool="gpu-a", isolation="dedicated")
    assert err.value.code == "pool_not_empty"
    with pytest.raises(Conflict):
        tenant.update_tenant(session, actor=ACTOR, now=now(), ref="shared1", version=1, changes={"pool": "gpu-b"})


def test_suspend_resume_are_idempotent(session) -> None:  # type: ignore[no-untyped-def]
    make_placement(session)
    before = _events(session)
    t = tenant.suspend_tenant(session, actor=ACTOR, now=now(), ref="acme")
    assert (t.status, t.version) == ("suspended", 2)
    t = tenant.suspend_tenant(session, actor=ACTOR, now=now(), ref="acme")
    assert (t.status, t.version) == ("suspended", 2)
    assert _events(session) == before + 1
    with pytest.raises(StaleVersion):
        tenant.resume_tenant(session, actor=ACTOR, now=now(), ref="acme", version=1)
    t = tenant.resume_tenant(session, actor=ACTOR, now=now(), ref="acme", version=2)
    assert (t.status, t.version) == ("active", 3)


def test_pagination_bounds(session) -> None:  # type: ignore[no-untyped-def]
    for i in range(5):
        make_pool(session, f"p{i}")
    page = pools.list_pools(session, limit=2, offset=3)
    assert [p.name for p in page.items] == ["p3", "p4"] and page.total == 5
    for bad in (0, 501):
        with pytest.raises(InvalidField) as err:
            pools.list_pools(session, limit=bad)
        assert err.value.field == "limit"
    with pytest.raises(InvalidField):
        pools.list_pools(session, offset=-1)
