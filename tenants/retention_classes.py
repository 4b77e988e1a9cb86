"""Retention classes: TensorRT-LLM retention priority/duration per prompt segment.

Each segment (system, context, turn) and the decoded tokens get a priority in
[0, 100] and a duration in ms (None = never expires), exactly the fields of
``KvCacheRetentionConfig`` (TensorRT-LLM ``cpp/include/tensorrt_llm/executor/executor.h``).
Every mutation is one transaction with one audit event (``entity_type="retention_class"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tenants import audit
from tenants import validation as v
from tenants.common import Page, check_version, get_by_ref, mutation, paginate
from tenants.errors import InUse, InvalidField
from tenants.models import RetentionClass, Tenant

SEGMENT_FIELDS = ("system", "context", "turn", "decode")
MODES = ("static", "adaptive")

_VALIDATORS: dict[str, Any] = {
    "name": lambda x: v.name(x, field="name"),
    "description": lambda x: v.text(x, field="description", max_len=2000, allow_empty=True),
    "mode": lambda x: v.choice(x, field="mode", options=MODES),
    # Client cache hints (retention/policy/hint_plan.py): off unless the class opts in.
    "hints_enabled": lambda x: v.boolean(x, field="hints_enabled"),
    "hint_max_ttl_ms": lambda x: v.positive_duration(x, field="hint_max_ttl_ms"),
    "hint_max_priority": lambda x: v.priority(x, field="hint_max_priority"),
    "hint_quota_fraction": lambda x: v.fraction(x, field="hint_quota_fraction"),
    # The conversation and tool-loop hold (retention/policy/conversation.py), within the hint caps.
    "conversation_hold_enabled": lambda x: v.boolean(x, field="conversation_hold_enabled"),
    # The run's-end demote (server/gateway/api/conversation_demote.py), independent of the hold.
    "conversation_end_demote_enabled": lambda x: v.boolean(x, field="conversation_end_demote_enabled"),
}
for _seg in SEGMENT_FIELDS:
    _VALIDATORS[f"{_seg}_priority"] = lambda x, f=f"{_seg}_priority": v.priority(x, field=f)
    _VALIDATORS[f"{_seg}_duration_ms"] = lambda x, f=f"{_seg}_duration_ms": v.duration(x, field=f)
UPDATABLE = frozenset(_VALIDATORS)


def _validated(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _VALIDATORS:
            raise InvalidField(f"unknown or read-only field {key!r}", field=key)
        out[key] = _VALIDATORS[key](value)
    return out


def create_class(
    session: Session,
    *,
    actor: str,
    now: datetime,
    name: str,
    description: str = "",
    system_priority: int = 90,
    system_duration_ms: int | None = None,
    context_priority: int = 60,
    context_duration_ms: int | None = 600_000,
    turn_priority: int = 35,
    turn_duration_ms: int | None = 30_000,
    decode_priority: int = 35,
    decode_duration_ms: int | None = 30_000,
    mode: str = "static",
    hints_enabled: bool = False,
    hint_max_ttl_ms: int = 3_600_000,
    hint_max_priority: int = 60,
    hint_quota_fraction: float = 0.5,
    conversation_hold_enabled: bool = False,
    conversation_end_demote_enabled: bool = False,
) -> RetentionClass:
    """Defaults: system prompts pinned high, context kept ~10 min, the last turn ~30 s;
    client hints ignored (when enabled: at most 1 h, priority 60, half the tenant's quota);
    no conversation or tool-loop hold (when enabled: within the same hint caps); no run's-end
    demote (when enabled: whatever the hold's switch says)."""
    values = _validated(
        dict(
            name=name,
            description=description,
            system_priority=system_priority,
            system_duration_ms=system_duration_ms,
            context_priority=context_priority,
            context_duration_ms=context_duration_ms,
            turn_priority=turn_priority,
            turn_duration_ms=turn_duration_ms,
            decode_priority=decode_priority,
            decode_duration_ms=decode_duration_ms,
            mode=mode,
            hints_enabled=hints_enabled,
            hint_max_ttl_ms=hint_max_ttl_ms,
            hint_max_priority=hint_max_priority,
            hint_quota_fraction=hint_quota_fraction,
            conversation_hold_enabled=conversation_hold_enabled,
            conversation_end_demote_enabled=conversation_end_demote_enabled,
        )
    )
    with mutation(session, unique_field="name", entity="retention class"):
        row = audit.audited_insert(session, RetentionClass(**values, created_at=now, updated_at=now, version=1),
                                   actor=actor, now=now, entity_type="retention_class")
    return row


def get_class(session: Session, *, ref: int | str) -> RetentionClass:
    return get_by_ref(session, RetentionClass, ref, name_attr="name", what="retention class")


def list_classes(session: Session, *, limit: int = 50, offset: int = 0) -> Page[RetentionClass]:
    return paginate(session, select(RetentionClass).order_by(RetentionClass.id), limit=limit, offset=offset)


def update_class(
    session: Session, *, actor: str, now: datetime, ref: int | str, version: int, changes: Mapping[str, Any]
) -> RetentionClass:
    values = _validated(changes)
    with mutation(session, unique_field="name", entity="retention class"):
        row = get_class(session, ref=ref)
        check_version(row, version)
        audit.audited_update(session, row, actor=actor, now=now, entity_type="retention_class", version=version,
                             values=values)
    return row


def delete_class(session: Session, *, actor: str, now: datetime, ref: int | str) -> None:
    with mutation(session, entity="retention class"):
        row = get_class(session, ref=ref)
        users = session.scalar(select(func.count()).select_from(Tenant).where(Tenant.retention_class_id == row.id)) or 0
        if users:
            raise InUse(f"retention class {row.name!r} is used by {users} tenant(s)", code="retention_class_in_use")
        audit.audited_delete(session, row, actor=actor, now=now, entity_type="retention_class")
