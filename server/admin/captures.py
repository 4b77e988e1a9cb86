"""Admin routes for live trace captures: ``/pools/{ref}/captures[/{id}[/stop]]``.

Thin: rules in ``tenants.captures``; a capture's secret key never appears in a response.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, status
from pydantic import BaseModel, Field

from server.admin.deps import AdminActor, NowDep, Paging, SessionDep
from server.admin.schemas import PageOf, Strict
from tenants import captures
from tenants.captures import DEFAULT_MAX_BYTES, MAX_BYTES

router = APIRouter(prefix="/pools", tags=["captures"])


class CaptureCreate(Strict):
    sample_rate: float = Field(1.0, gt=0, le=1, description="share of requests written (stable per conversation)")
    max_bytes: int = Field(DEFAULT_MAX_BYTES, strict=True, ge=1, le=MAX_BYTES,
                           description="size bound of each gateway's capture file; writing stops when reached")
    tenant: str | None = Field(None, min_length=1, max_length=64, description="only this tenant's requests (slug or id)")


class CapturePublic(BaseModel):
    id: int
    pool: str | None
    tenant: str | None
    sample_rate: float
    max_bytes: int
    state: str
    started_at: datetime
    stopped_at: datetime | None
    version: int


@router.post("/{ref}/captures", status_code=status.HTTP_201_CREATED, response_model=CapturePublic)
def start_capture(ref: str, body: CaptureCreate, session: SessionDep, actor: AdminActor, now: NowDep) -> CapturePublic:
    """Start capturing the pool's requests (409 ``capture_active`` if one is running)."""
    row = captures.start_capture(session, actor=actor, now=now, pool=ref, **body.model_dump())
    return CapturePublic(**captures.capture_public(row, session))


@router.get("/{ref}/captures", response_model=PageOf[CapturePublic])
def list_captures(ref: str, session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[CapturePublic]:
    """The pool's captures, newest first, a page at a time."""
    result = captures.list_captures(session, pool=ref, limit=page.limit, offset=page.offset)
    return PageOf[CapturePublic](
        items=[CapturePublic(**c) for c in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )


@router.get("/{ref}/captures/{capture_id}", response_model=CapturePublic)
def get_capture(ref: str, capture_id: str, session: SessionDep, _actor: AdminActor) -> CapturePublic:
    return CapturePublic(**captures.capture_public(captures.get_capture(session, pool=ref, capture_id=capture_id),
                                                   session))


@router.post("/{ref}/captures/{capture_id}/stop", response_model=CapturePublic)
def stop_capture(ref: str, capture_id: str, session: SessionDep, actor: AdminActor, now: NowDep) -> CapturePublic:
    """Stop the capture; gateways close its file at their next refresh."""
    row = captures.stop_capture(session, actor=actor, now=now, pool=ref, capture_id=capture_id)
    return CapturePublic(**captures.capture_public(row, session))
