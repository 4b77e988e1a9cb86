"""Tenants: placement (pool), retention class, isolation, limits and KV quota.

Invariants:

* ``cache_salt`` is generated here (``secrets.token_hex(16)``) and cannot be set by
  any caller; audit snapshots omit it.
* A ``dedicated`` tenant is alone on its pool: it cannot join a pool with other
  tenants, and nobody can join its pool.
* ``status`` changes only through ``suspend_tenant`` / ``resume_tenant``; each
  mutation bumps ``version`` and writes one audit event in its transaction. A
  suspend of an already suspended tenant (or resume of an active one) changes
  nothing and records nothing.
* A delete is audited whole: besides ``tenant.delete``, one event per row that goes with
  the tenant and has an audit history (its API keys, the captures limited to it, a scoped
  admin credential's scope), in the same transaction; it is refused while it would leave
  an admin credential scoped to no tenant (``admin_credentials.release_tenant``).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import false, func, select
from sqlalchemy.orm import Session

from tenants import admin_credentials, audit, captures, keys
from tenants import validation as v
from tenants.common import Page, check_version, get_by_ref, mutation, paginate, snapshot, versioned_update
from tenants.errors import Conflict, Forbidden, InvalidField
from tenants.models import CAPPED_LIMITS, ApiKey, Pool, RetentionClass, Tenant, TraceCapture
from tenants.pools import get_pool
from tenants.retention_classes import get_class

DEFAULT_LIMITS = {
    "rpm_limit": 600,
    "tpm_limit": 200_000,
    "max_concurrent_requests": 16,
    "max_prompt_tokens": 8192,
    "max_output_tokens": 1024,
}
DEFAULT_KV_QUOTA = 0.5
SECRET_FIELDS = ("cache_salt",)

_VALIDATORS: dict[str, Any] = {
    "display_name": lambda x: v.text(x, field="display_name", max_len=256),
    "isolation": lambda x: v.isolation(x),
    "kv_quota_fraction": lambda x: v.fraction(x, field="kv_quota_fraction"),
    **{key: (lambda x, f=key: v.integer(x, field=f, minimum=1)) for key in DEFAULT_LIMITS},
    "limit_caps": lambda x: normalized_caps(x),
}
# ``pool`` and ``retention_class`` (id or name) are resolved separately.
UPDATABLE = frozenset(_VALIDATORS) | {"pool", "retention_class"}


def normalized_caps(value: Any) -> dict[str, Any] | None:
    """``{limit: cap}`` for fields of ``CAPPED_LIMITS``; None entries dropped; empty -> None
    (what the registry stores: a plan compares a file's caps through this, so ``{}`` matches NULL)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidField("limit_caps must be an object", field="limit_caps")
    out: dict[str, Any] = {}
    for key, cap in value.items():
        if key not in CAPPED_LIMITS:
            raise InvalidField(f"no cap can be set on {key!r}", field=f"limit_caps.{key}")
        if cap is not None:
            out[key] = _VALIDATORS[key](cap)
    return out or None


def check_within_caps(tenant: Tenant, changes: Mapping[str, Any]) -> None:
    """Refuse (403) what a tenant-admin may not change: anything but a capped limit, or a
    limit above its cap. Lowering a capped limit is always allowed."""
    caps = tenant.limit_caps or {}
    for key, value in changes.items():
        if key not in CAPPED_LIMITS:
            raise Forbidden(f"a tenant-admin may change only its limits, not {key!r}", field=key,
                            code="field_not_permitted")
        if key not in caps:
            raise Forbidden(f"{key} has no cap; only a platform admin may change it", field=key,
                            code="limit_not_capped")
        if value > caps[key]:
            raise Forbidden(f"{key} {value} is above its cap {caps[key]}", field=key, code="limit_above_cap")


def new_cache_salt() -> str:
    return secrets.token_hex(16)


def audit_view(tenant: Tenant) -> dict[str, Any]:
    return snapshot(tenant, exclude=SECRET_FIELDS)


def _validated(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _VALIDATORS:
            raise InvalidField(f"unknown or read-only field {key!r}", field=key)
        out[key] = _VALIDATORS[key](value)
    return out


def _lock_pool(session: Session, pool_id: int) -> None:
    """Before a write that places a tenant on ``pool_id``: on PostgreSQL, hold the pool's row
    (``FOR UPDATE``, as ``tenants.replicas`` does for replica removals) until the transaction
    ends, so two placements on one pool run one after the other. SQLite needs no lock here: its
    write transaction is the lock, and ``_check_dedication`` runs after the write, inside it."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Pool.id).where(Pool.id == pool_id).with_for_update())


def _check_dedication(session: Session, *, pool: Pool, isolation: str, tenant_id: int) -> None:
    """Refuse (409) a placement that breaks dedication; run AFTER the tenant's row is written
    (and, on PostgreSQL, after ``_lock_pool``): a check before the write, with nothing held,
    let a dedicated and a salted tenant created at once on an empty pool both pass."""
    others = select(Tenant).where(Tenant.pool_id == pool.id, Tenant.id != tenant_id)
    if isolation == "dedicated":
        count = session.scalar(select(func.count()).select_from(others.subquery())) or 0
        if count:
            raise Conflict(
                f"pool {pool.name!r} already has {count} tenant(s); a dedicated tenant needs its own pool",
                field="pool",
                code="pool_not_empty",
            )
    else:
        owner = session.scalars(others.where(Tenant.isolation == "dedicated").limit(1)).first()
        if owner is not None:
            raise Conflict(
                f"pool {pool.name!r} is dedicated to tenant {owner.slug!r}", field="pool", code="pool_dedicated"
            )


def create_tenant(
    session: Session,
    *,
    actor: str,
    now: datetime,
    slug: str,
    display_name: str,
    pool: int | str,
    retention_class: int | str,
    isolation: str = "salted",
    kv_quota_fraction: float = DEFAULT_KV_QUOTA,
    rpm_limit: int = DEFAULT_LIMITS["rpm_limit"],
    tpm_limit: int = DEFAULT_LIMITS["tpm_limit"],
    max_concurrent_requests: int = DEFAULT_LIMITS["max_concurrent_requests"],
    max_prompt_tokens: int = DEFAULT_LIMITS["max_prompt_tokens"],
    max_output_tokens: int = DEFAULT_LIMITS["max_output_tokens"],
    limit_caps: Mapping[str, Any] | None = None,
) -> Tenant:
    """Create an active tenant; ``pool``/``retention_class`` are ids or names (unknown → 422 on that field)."""
    slug = v.name(slug, field="slug")
    values = _validated(
        dict(
            display_name=display_name,
            isolation=isolation,
            kv_quota_fraction=kv_quota_fraction,
            rpm_limit=rpm_limit,
            tpm_limit=tpm_limit,
            max_concurrent_requests=max_concurrent_requests,
            max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=max_output_tokens,
            limit_caps=limit_caps,
        )
    )
    with mutation(session, unique_field="slug", entity="tenant"):
        pool_row = get_by_ref(session, Pool, pool, name_attr="name", what="pool", field="pool")
        class_row = get_by_ref(
            session, RetentionClass, retention_class, name_attr="name", what="retention class", field="retention_class"
        )
        _lock_pool(session, pool_row.id)
        tenant = Tenant(
            slug=slug,
            status="active",
            pool_id=pool_row.id,
            retention_class_id=class_row.id,
            cache_salt=new_cache_salt(),
            created_at=now,
            updated_at=now,
            version=1,
            **values,
        )
        audit.audited_insert(session, tenant, actor=actor, now=now, entity_type="tenant", view=audit_view)
        _check_dedication(session, pool=pool_row, isolation=tenant.isolation, tenant_id=tenant.id)
    return tenant


def get_tenant(session: Session, *, ref: int | str, within: Collection[int] | None = None) -> Tenant:
    """The tenant ``ref`` names; with ``within`` (a caller's scope) one outside it is not found,
    by the same query and the same error as one that does not exist."""
    return get_by_ref(session, Tenant, ref, name_attr="slug", what="tenant", within=within)


def list_tenants(
    session: Session, *, limit: int = 50, offset: int = 0, status: str | None = None, pool: int | str | None = None,
    within: Collection[int] | None = None,
) -> Page[Tenant]:
    """A page of tenants; with ``within`` only those (``total`` counts only those).

    ``pool`` filters by pool id or name; an unknown one is a 422 for an unscoped caller, but for a
    scoped one (``within``) it is an empty page, as a pool it cannot see is: a scoped caller may not
    list pools, so no answer tells it which exist."""
    stmt = select(Tenant)
    if within is not None:
        stmt = stmt.where(Tenant.id.in_(sorted(within)))
    if status is not None:
        stmt = stmt.where(Tenant.status == v.status(status))
    if pool is not None:
        try:
            pool_id = get_by_ref(session, Pool, pool, name_attr="name", what="pool", field="pool").id
        except InvalidField:
            if within is None:
                raise
            pool_id = None  # matches no tenant
        stmt = stmt.where(Tenant.pool_id == pool_id) if pool_id is not None else stmt.where(false())
    return paginate(session, stmt.order_by(Tenant.id), limit=limit, offset=offset)


def update_tenant(
    session: Session, *, actor: str, now: datetime, ref: int | str, version: int, changes: Mapping[str, Any],
    within_caps: bool = False, check_dedication: bool = True,
) -> Tenant:
    """Apply ``changes`` (any of ``UPDATABLE``) if ``version`` is current, else ``StaleVersion``.
    No changes at all (a PATCH with only its version) writes nothing and returns the row.

    ``within_caps`` (a tenant-admin's change): ``check_within_caps`` on the row read in the
    same transaction, so a cap lowered concurrently is not raced past. ``check_dedication=False``
    (a batch of moves, ``tenants.declarative.apply``): the caller runs :func:`check_placement`
    for the tenant once the batch's end state is written, in the same transaction.
    """
    changes = dict(changes)
    pool_ref = changes.pop("pool", None)
    class_ref = changes.pop("retention_class", None)
    values = _validated(changes)
    with mutation(session, entity="tenant"):
        tenant = get_tenant(session, ref=ref)
        if within_caps:
            check_within_caps(tenant, {**values, **({"pool": pool_ref} if pool_ref is not None else {}),
                                       **({"retention_class": class_ref} if class_ref is not None else {})})
        check_version(tenant, version)
        if pool_ref is not None:
            values["pool_id"] = get_by_ref(session, Pool, pool_ref, name_attr="name", what="pool", field="pool").id
        if class_ref is not None:
            values["retention_class_id"] = get_by_ref(
                session, RetentionClass, class_ref, name_attr="name", what="retention class", field="retention_class"
            ).id
        placing = "pool_id" in values or "isolation" in values
        if placing:
            _lock_pool(session, values.get("pool_id", tenant.pool_id))
        audit.audited_update(session, tenant, actor=actor, now=now, entity_type="tenant", version=version,
                             values=values, view=audit_view)
        if placing and check_dedication:  # after the write, like create_tenant: see _check_dedication
            check_placement(session, tenant)
    return tenant


def check_placement(session: Session, tenant: Tenant) -> None:
    """``_check_dedication`` for ``tenant`` where it stands now (its pool and isolation as written)."""
    target = session.get(Pool, tenant.pool_id)
    assert target is not None
    _check_dedication(session, pool=target, isolation=tenant.isolation, tenant_id=tenant.id)


def _set_status(
    session: Session, *, actor: str, now: datetime, ref: int | str, status: str, version: int | None
) -> Tenant:
    with mutation(session, entity="tenant"):
        tenant = get_tenant(session, ref=ref)
        expected = tenant.version if version is None else check_version(tenant, version)
        if tenant.status == status:
            return tenant
        before = audit_view(tenant)
        versioned_update(session, tenant, expected_version=expected, values={"status": status}, now=now)
        action = "tenant.suspend" if status == "suspended" else "tenant.resume"
        audit.record(
            session,
            actor=actor,
            action=action,
            entity_type="tenant",
            entity_id=tenant.id,
            before=before,
            after=audit_view(tenant),
            now=now,
        )
    return tenant


def suspend_tenant(
    session: Session, *, actor: str, now: datetime, ref: int | str, version: int | None = None
) -> Tenant:
    """Suspend (keys stop authenticating as usable). ``version`` is optional here."""
    return _set_status(session, actor=actor, now=now, ref=ref, status="suspended", version=version)


def resume_tenant(session: Session, *, actor: str, now: datetime, ref: int | str, version: int | None = None) -> Tenant:
    return _set_status(session, actor=actor, now=now, ref=ref, status="active", version=version)


def delete_tenant(session: Session, *, actor: str, now: datetime, ref: int | str) -> None:
    """Delete a tenant with its keys, captures, usage rows and stored responses (FK ``CASCADE``;
    audit events stay). Records ``api_key.delete`` per key, ``trace_capture.delete`` per capture
    limited to it (an active one stops with it), the scope change of each admin credential that
    keeps other tenants, then ``tenant.delete``; 409 ``tenant_orphans_credential`` while it is a
    credential's only tenant (``admin_credentials.release_tenant``)."""
    with mutation(session, entity="tenant"):
        tenant = get_tenant(session, ref=ref)
        if session.get_bind().dialect.name == "postgresql":
            # Held to the end: a key, capture or credential scope added meanwhile (its FK insert
            # waits on this row) cannot slip into the cascade without its event.
            session.execute(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
        admin_credentials.release_tenant(session, actor=actor, now=now, tenant=tenant)
        for key in session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id)):
            audit.record(session, actor=actor, action="api_key.delete", entity_type="api_key", entity_id=key.id,
                         before=keys.audit_view(key), after=None, now=now)
        for capture in session.scalars(select(TraceCapture).where(TraceCapture.tenant_id == tenant.id)
                                       .order_by(TraceCapture.id)):
            audit.record(session, actor=actor, action="trace_capture.delete", entity_type="trace_capture",
                         entity_id=capture.id, before=captures.audit_view(capture), after=None, now=now)
        audit.audited_delete(session, tenant, actor=actor, now=now, entity_type="tenant", view=audit_view)


def placement(session: Session, *, tenant: Tenant) -> tuple[Pool, RetentionClass]:
    pool = get_pool(session, ref=tenant.pool_id)
    cls = get_class(session, ref=tenant.retention_class_id)
    return pool, cls
