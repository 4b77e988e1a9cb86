"""Admin routes for tenants: CRUD, suspend/resume, the computed retention view, usage."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from server.admin.captures import CapturePublic
from server.admin.deps import AdminActor, IdentityDep, NowDep, Paging, SessionDep
from server.admin.schemas import (
    PageOf,
    RetentionViewPublic,
    SegmentViewPublic,
    StatusChange,
    TenantCreate,
    TenantDetail,
    TenantPublic,
    TenantUpdate,
    UsageMinutePublic,
    UsageReportPublic,
    UsageTotalsPublic,
)
from server.errors import ApiError
from tenants import captures
from tenants import tenant as tenant_service
from tenants.errors import InvalidField
from tenants.models import Pool, RetentionClass, Tenant
from tenants.snapshots import PoolSnapshot, RetentionClassSnapshot
from tenants.usage import usage_report
from tenants.validation import utc
from tenants.views import retention_view

router = APIRouter(prefix="/tenants", tags=["tenants"])

_PUBLIC_FIELDS = tuple(f for f in TenantPublic.model_fields if f not in ("pool", "retention_class"))


def _public(tenant: Tenant, pool_name: str, class_name: str) -> TenantPublic:
    data = {f: getattr(tenant, f) for f in _PUBLIC_FIELDS}
    return TenantPublic(**data, pool=pool_name, retention_class=class_name)


def tenant_publics(session: Session, rows: list[Tenant]) -> list[TenantPublic]:
    pool_names = dict(session.execute(select(Pool.id, Pool.name).where(Pool.id.in_({t.pool_id for t in rows}))).all())
    class_names = dict(
        session.execute(
            select(RetentionClass.id, RetentionClass.name).where(
                RetentionClass.id.in_({t.retention_class_id for t in rows})
            )
        ).all()
    )
    return [_public(t, pool_names[t.pool_id], class_names[t.retention_class_id]) for t in rows]


def tenant_detail(session: Session, tenant: Tenant) -> TenantDetail:
    pool, cls = tenant_service.placement(session, tenant=tenant)
    view = retention_view(PoolSnapshot.of(pool), RetentionClassSnapshot.of(cls))
    return TenantDetail(
        **_public(tenant, pool.name, cls.name).model_dump(),
        retention_view=[SegmentViewPublic.model_validate(s) for s in view],
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TenantDetail)
def create_tenant(body: TenantCreate, session: SessionDep, actor: AdminActor, now: NowDep) -> TenantDetail:
    return tenant_detail(session, tenant_service.create_tenant(session, actor=actor, now=now, **body.model_dump()))


@router.get("", response_model=PageOf[TenantPublic])
def list_tenants(
    session: SessionDep,
    identity: IdentityDep,
    page: Paging,
    status_: Annotated[str | None, Query(alias="status", pattern="^(active|suspended)$")] = None,
    pool: Annotated[str | None, Query(description="pool id or name")] = None,
) -> PageOf[TenantPublic]:
    """A scoped caller sees only its tenants (``total`` counts only those)."""
    result = tenant_service.list_tenants(session, limit=page.limit, offset=page.offset, status=status_, pool=pool,
                                         within=identity.tenant_ids)
    return PageOf[TenantPublic](
        items=tenant_publics(session, list(result.items)), total=result.total, limit=result.limit, offset=result.offset
    )


@router.get("/{ref}", response_model=TenantDetail)
def get_tenant(ref: str, session: SessionDep, _actor: AdminActor) -> TenantDetail:
    return tenant_detail(session, tenant_service.get_tenant(session, ref=ref))


@router.patch("/{ref}", response_model=TenantDetail)
def update_tenant(
    ref: str, body: TenantUpdate, session: SessionDep, identity: IdentityDep, now: NowDep
) -> TenantDetail:
    """A tenant-admin may change only limits that have a cap, up to the cap (403 otherwise)."""
    changes = body.model_dump(exclude_unset=True, exclude={"version"})
    for reference in ("pool", "retention_class"):
        if reference in changes and changes[reference] is None:
            changes.pop(reference)
    tenant = tenant_service.update_tenant(session, actor=identity.actor, now=now, ref=ref, version=body.version,
                                          changes=changes, within_caps=identity.role == "tenant-admin")
    return tenant_detail(session, tenant)


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT)
def delete_tenant(ref: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    tenant_service.delete_tenant(session, actor=actor, now=now, ref=ref)


@router.post("/{ref}/suspend", response_model=TenantDetail)
def suspend_tenant(
    ref: str, session: SessionDep, actor: AdminActor, now: NowDep, body: StatusChange | None = None
) -> TenantDetail:
    version = body.version if body is not None else None
    return tenant_detail(
        session, tenant_service.suspend_tenant(session, actor=actor, now=now, ref=ref, version=version)
    )


@router.post("/{ref}/resume", response_model=TenantDetail)
def resume_tenant(
    ref: str, session: SessionDep, actor: AdminActor, now: NowDep, body: StatusChange | None = None
) -> TenantDetail:
    version = body.version if body is not None else None
    return tenant_detail(session, tenant_service.resume_tenant(session, actor=actor, now=now, ref=ref, version=version))


@router.get("/{ref}/retention", response_model=RetentionViewPublic)
def get_retention_view(ref: str, session: SessionDep, _actor: AdminActor) -> RetentionViewPublic:
    """Per segment: priority, duration and where evicted blocks go (host tier or dropped)."""
    tenant = tenant_service.get_tenant(session, ref=ref)
    pool, cls = tenant_service.placement(session, tenant=tenant)
    view = retention_view(PoolSnapshot.of(pool), RetentionClassSnapshot.of(cls))
    return RetentionViewPublic(
        tenant=tenant.slug,
        pool=pool.name,
        secondary_offload_min_priority=pool.secondary_offload_min_priority,
        secondary_blocks=pool.secondary_blocks,
        segments=[SegmentViewPublic.model_validate(s) for s in view],
    )


@router.get("/{ref}/usage", response_model=UsageReportPublic)
def get_usage(
    ref: str,
    session: SessionDep,
    _actor: AdminActor,
    page: Paging,
    start: Annotated[datetime | None, Query(
        alias="from", description="inclusive, ISO 8601 with offset; a time inside a minute rounds up to the "
        "next minute start")] = None,
    end: Annotated[datetime | None, Query(
        alias="to", description="exclusive, ISO 8601 with offset; a time inside a minute rounds up to the "
        "next minute start")] = None,
) -> UsageReportPublic:
    """Totals and per-minute rows (oldest first) over ``[from, to)``, half-open on minute buckets.

    A minute is in the window iff its start is: both bounds round up to the next minute start,
    so windows cut at the same instant (on a minute or not) never share a minute and sum to
    the whole, and ``from == to`` is empty. ``start``/``end`` echo the bounds as given. Of the
    prompt tokens, ``cache_read_tokens`` were served from the KV cache and ``cache_write_5m_tokens``
    / ``cache_write_1h_tokens`` kept under a client cache hint (minutes counted before the ledger
    had them read 0)."""
    bounds = {}
    for name, value in (("from", start), ("to", end)):
        if value is not None and value.tzinfo is None:
            raise ApiError(422, "invalid_value", f"{name} must include a timezone offset", field=name)
        try:  # a time UTC cannot hold (9999-12-31T23:59-05:00) is refused naming the parameter
            bounds[name] = None if value is None else utc(value, field=name)
        except InvalidField as exc:
            raise ApiError(422, exc.code, exc.message, field=name) from None
    tenant = tenant_service.get_tenant(session, ref=ref)
    totals, rows = usage_report(session, tenant=tenant.id, start=bounds["from"], end=bounds["to"], limit=page.limit,
                                offset=page.offset)
    return UsageReportPublic(
        tenant=tenant.slug,
        start=start,
        end=end,
        total=UsageTotalsPublic.model_validate(totals),
        items=[UsageMinutePublic.model_validate(r) for r in rows.items],
        total_minutes=rows.total,
        limit=rows.limit,
        offset=rows.offset,
    )


@router.get("/{ref}/captures", response_model=PageOf[CapturePublic])
def list_tenant_captures(ref: str, session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[CapturePublic]:
    """Captures that record only this tenant's requests (state and bounds), newest first, a page at a time."""
    tenant = tenant_service.get_tenant(session, ref=ref)
    result = captures.list_tenant_captures(session, tenant=tenant.id, limit=page.limit, offset=page.offset)
    return PageOf[CapturePublic](items=[CapturePublic(**c) for c in result.items], total=result.total,
                                 limit=result.limit, offset=result.offset)

