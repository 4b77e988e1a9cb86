"""The audit log: one event per admin mutation, written in the mutation's transaction.

``record`` only adds the row to the session; the caller's ``mutation`` block commits
it together with the change, so a failed change never leaves an event and a committed
change always does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenants import validation as v
from tenants.common import Page, paginate, snapshot, versioned_update
from tenants.models import AuditEvent


def record(
    session: Session,
    *,
    actor: str,
    action: str,
    entity_type: str,
    entity_id: int | str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    now: datetime,
) -> AuditEvent:
    event = AuditEvent(
        at=now,
        actor=actor,
        action=action,
        entity_type=entity_type,
        entity_id=str(entity_id),
        before=before,
        after=after,
    )
    session.add(event)
    return event


def audited_insert(session: Session, row: Any, *, actor: str, now: datetime, entity_type: str,
                   view: Callable[[Any], dict[str, Any]] = snapshot) -> Any:
    """Add ``row`` and its ``<entity_type>.create`` event (inside the caller's ``mutation``)."""
    session.add(row)
    session.flush()
    record(session, actor=actor, action=f"{entity_type}.create", entity_type=entity_type, entity_id=row.id,
           before=None, after=view(row), now=now)
    return row


def audited_update(session: Session, row: Any, *, actor: str, now: datetime, entity_type: str, version: int,
                   values: dict[str, Any], view: Callable[[Any], dict[str, Any]] = snapshot,
                   action: str | None = None) -> Any:
    """Versioned update of ``row`` plus its ``<entity_type>.update`` event (or ``action``; before/after views).

    No ``values`` (an update that names no field, e.g. a PATCH carrying only its version, which
    the caller has checked) writes nothing: no version bump, no empty event."""
    if not values:
        return row
    before = view(row)
    versioned_update(session, row, expected_version=version, values=values, now=now)
    record(session, actor=actor, action=action or f"{entity_type}.update", entity_type=entity_type, entity_id=row.id,
           before=before, after=view(row), now=now)
    return row


def audited_delete(session: Session, row: Any, *, actor: str, now: datetime, entity_type: str,
                   view: Callable[[Any], dict[str, Any]] = snapshot) -> None:
    """Delete ``row`` and record its ``<entity_type>.delete`` event (the event outlives the row)."""
    before = view(row)
    session.delete(row)
    session.flush()
    record(session, actor=actor, action=f"{entity_type}.delete", entity_type=entity_type, entity_id=before["id"],
           before=before, after=None, now=now)


def list_events(
    session: Session,
    *,
    limit: int = 50,
    offset: int = 0,
    entity_type: str | None = None,
    entity_id: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    hidden_entity_types: Collection[str] = (),
) -> Page[AuditEvent]:
    """Newest first; every filter is optional and they combine with AND.

    ``hidden_entity_types`` (what a caller may not read) is part of the query, so pages are
    full and ``total`` counts only what the caller may read.

    A text filter with a NUL, or a time that is naive or that UTC cannot hold, is refused
    (``InvalidField`` naming the filter) on every backend alike."""
    stmt = select(AuditEvent)
    if hidden_entity_types:
        stmt = stmt.where(AuditEvent.entity_type.not_in(sorted(hidden_entity_types)))
    if entity_type is not None:
        stmt = stmt.where(AuditEvent.entity_type == v.filter_text(entity_type, field="entity_type"))
    if entity_id is not None:
        stmt = stmt.where(AuditEvent.entity_id == v.filter_text(str(entity_id), field="entity_id"))
    if action is not None:
        stmt = stmt.where(AuditEvent.action == v.filter_text(action, field="action"))
    if actor is not None:
        stmt = stmt.where(AuditEvent.actor == v.filter_text(actor, field="actor"))
    if since is not None:
        stmt = stmt.where(AuditEvent.at >= v.utc(since, field="since"))
    if until is not None:
        stmt = stmt.where(AuditEvent.at < v.utc(until, field="until"))
    return paginate(session, stmt.order_by(AuditEvent.id.desc()), limit=limit, offset=offset)
