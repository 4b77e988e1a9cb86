"""Admin route for the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from server.admin.deps import IdentityDep, Paging, SessionDep
from server.admin.permissions import hidden_audit_entities
from server.admin.schemas import AuditEventPublic, PageOf
from server.errors import ApiError
from tenants import audit

router = APIRouter(prefix="/audit", tags=["audit"])


@router.get("", response_model=PageOf[AuditEventPublic])
def list_audit(
    session: SessionDep,
    identity: IdentityDep,
    page: Paging,
    entity_type: Annotated[str | None, Query(max_length=32)] = None,
    entity_id: Annotated[str | None, Query(max_length=64)] = None,
    action: Annotated[str | None, Query(max_length=64)] = None,
    actor: Annotated[str | None, Query(max_length=128)] = None,
    since: Annotated[datetime | None, Query(description="inclusive, ISO 8601 with offset")] = None,
    until: Annotated[datetime | None, Query(description="exclusive, ISO 8601 with offset")] = None,
) -> PageOf[AuditEventPublic]:
    """Newest first; only events of entities the caller may read (``AUDIT_READ_RULES``): an
    operator sees no credential or API key event, a viewer no credential event."""
    for name, value in (("since", since), ("until", until)):
        if value is not None and value.tzinfo is None:
            raise ApiError(422, "invalid_value", f"{name} must include a timezone offset", field=name)
    result = audit.list_events(
        session,
        limit=page.limit,
        offset=page.offset,
        entity_type=entity_type,
        entity_id=entity_id,
        action=action,
        actor=actor,
        since=since,
        until=until,
        hidden_entity_types=hidden_audit_entities(identity),
    )
    return PageOf[AuditEventPublic](
        items=[AuditEventPublic.model_validate(e) for e in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )
