"""Live trace captures: opt-in, per pool (optionally one tenant), audited.

A capture tells every gateway serving the pool to write a sample of the pool's requests
as a Mooncake-format JSONL trace (``server/gateway/observe/capture.py``). The registry holds only
the switch and its parameters; the files live in the gateways' trace directory.

Invariants:

* At most one ``active`` capture per pool (checked here with code ``capture_active``,
  kept by the partial unique index ``uq_trace_captures_active_pool``).
* ``0 < sample_rate <= 1``; ``1 <= max_bytes <= MAX_BYTES``; a tenant filter names a
  tenant of the same pool.
* ``key`` (32 random bytes, hex) is generated here, never accepted from a caller, never
  returned by the admin API and never written to the audit log (``audit_view``).
* Every change is one transaction with one audit event (``entity_type="trace_capture"``,
  actions ``trace_capture.create`` / ``trace_capture.stop``); stopping a stopped capture
  changes nothing and records nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenants import audit
from tenants import validation as v
from tenants.common import Page, get_by_ref, id_value, mutation, paginate, snapshot
from tenants.errors import Conflict, InvalidField, NotFound
from tenants.models import Pool, Tenant, TraceCapture

MAX_BYTES = 2**40  # 1 TiB: a bound, not a suggestion
DEFAULT_MAX_BYTES = 256 * 2**20


def audit_view(capture: TraceCapture) -> dict[str, Any]:
    return snapshot(capture, exclude=("key",))


@dataclass(frozen=True, slots=True)
class ActiveCapture:
    """What a gateway needs to write one pool's capture (read at refresh time)."""

    id: int
    pool: str
    tenant_id: int | None
    sample_rate: float
    max_bytes: int
    key: bytes


def _sample_rate(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise InvalidField(f"sample_rate must be a number in (0, 1], got {value!r}", field="sample_rate")
    return float(value)


def _pool(session: Session, ref: int | str) -> Pool:
    return get_by_ref(session, Pool, ref, name_attr="name", what="pool")


def start_capture(session: Session, *, actor: str, now: datetime, pool: int | str, sample_rate: float = 1.0,
                  max_bytes: int = DEFAULT_MAX_BYTES, tenant: int | str | None = None) -> TraceCapture:
    """Start capturing ``pool`` (only ``tenant``'s requests when given); 409 if one is active."""
    rate = _sample_rate(sample_rate)
    size = v.integer(max_bytes, field="max_bytes", minimum=1, maximum=MAX_BYTES)
    with mutation(session, unique_field="pool", entity="capture"):
        pool_row = _pool(session, pool)
        tenant_id = None
        if tenant is not None:
            tenant_row = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant", field="tenant")
            if tenant_row.pool_id != pool_row.id:
                raise InvalidField(f"tenant {tenant_row.slug!r} is not on pool {pool_row.name!r}", field="tenant",
                                   code="tenant_not_on_pool")
            tenant_id = tenant_row.id
        active = session.scalars(
            select(TraceCapture).where(TraceCapture.pool_id == pool_row.id, TraceCapture.state == "active")
        ).first()
        if active is not None:
            raise Conflict(f"pool {pool_row.name!r} already has an active capture (id {active.id}); stop it first",
                           field="pool", code="capture_active")
        row = TraceCapture(pool_id=pool_row.id, tenant_id=tenant_id, sample_rate=rate, max_bytes=size,
                           state="active", key=secrets.token_hex(32), started_at=now, stopped_at=None,
                           created_at=now, updated_at=now, version=1)
        audit.audited_insert(session, row, actor=actor, now=now, entity_type="trace_capture", view=audit_view)
    return row


def _find(session: Session, pool: Pool, capture_id: Any) -> TraceCapture:
    number = id_value(capture_id)  # None for a non-number, or one no id can be (any length)
    row = session.get(TraceCapture, number) if number is not None else None
    if row is None or row.pool_id != pool.id:
        raise NotFound(f"pool {pool.name!r} has no capture {str(capture_id)[:80]!r}", code="capture_not_found")
    return row


def get_capture(session: Session, *, pool: int | str, capture_id: int | str) -> TraceCapture:
    return _find(session, _pool(session, pool), capture_id)


def list_captures(session: Session, *, pool: int | str, limit: int = 50, offset: int = 0) -> Page[dict[str, Any]]:
    """A page of the pool's captures, newest first, as admin views (``capture_public``).

    A pool captured daily for years has thousands of rows: the page's rows come with their
    tenants' slugs in one query (no lookup per row), and ``total`` counts them all.
    """
    row = _pool(session, pool)
    stmt = (select(TraceCapture, Tenant.slug).outerjoin(Tenant, Tenant.id == TraceCapture.tenant_id)
            .where(TraceCapture.pool_id == row.id).order_by(TraceCapture.id.desc()))
    page = paginate(session, stmt, limit=limit, offset=offset, rows=True)
    return replace(page, items=[_public(c, row.name, slug) for c, slug in page.items])


def list_tenant_captures(session: Session, *, tenant: int, limit: int = 50, offset: int = 0) -> Page[dict[str, Any]]:
    """A page of the captures limited to ``tenant``'s requests, newest first, as admin views
    (``capture_public``): the rows with their pools' names in one query, as :func:`list_captures`."""
    slug = session.scalar(select(Tenant.slug).where(Tenant.id == tenant))
    stmt = (select(TraceCapture, Pool.name).outerjoin(Pool, Pool.id == TraceCapture.pool_id)
            .where(TraceCapture.tenant_id == tenant).order_by(TraceCapture.id.desc()))
    page = paginate(session, stmt, limit=limit, offset=offset, rows=True)
    return replace(page, items=[_public(c, name, slug) for c, name in page.items])


def stop_capture(session: Session, *, actor: str, now: datetime, pool: int | str, capture_id: int | str) -> TraceCapture:
    """Stop a capture (gateways stop writing at their next refresh); a no-op when stopped."""
    with mutation(session, entity="capture"):
        row = _find(session, _pool(session, pool), capture_id)
        if row.state == "stopped":
            return row
        audit.audited_update(session, row, actor=actor, now=now, entity_type="trace_capture", version=row.version,
                             values={"state": "stopped", "stopped_at": now}, view=audit_view,
                             action="trace_capture.stop")
    return row


def active_captures(session: Session) -> list[ActiveCapture]:
    """Every active capture with its pool's name and key (for the gateways only)."""
    rows = session.execute(
        select(TraceCapture, Pool.name).join(Pool, Pool.id == TraceCapture.pool_id)
        .where(TraceCapture.state == "active").order_by(TraceCapture.id)
    ).all()
    return [ActiveCapture(c.id, name, c.tenant_id, c.sample_rate, c.max_bytes, bytes.fromhex(c.key)) for c, name in rows]


def capture_public(capture: TraceCapture, session: Session) -> dict[str, Any]:
    """The admin view: no key; the tenant by slug."""
    slug = None
    if capture.tenant_id is not None:
        tenant = session.get(Tenant, capture.tenant_id)
        slug = tenant.slug if tenant is not None else None
    pool = session.get(Pool, capture.pool_id)
    return _public(capture, pool.name if pool else None, slug)


def _public(capture: TraceCapture, pool: str | None, tenant: str | None) -> dict[str, Any]:
    return {"id": capture.id, "pool": pool, "tenant": tenant, "sample_rate": capture.sample_rate,
            "max_bytes": capture.max_bytes, "state": capture.state, "started_at": capture.started_at,
            "stopped_at": capture.stopped_at, "version": capture.version}
