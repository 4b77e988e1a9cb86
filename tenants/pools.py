"""Pools: engine deployments tenants are placed on.

Every mutation is one transaction with one audit event (``entity_type="pool"``).
Deleting a pool that tenants still use raises ``InUse``.
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
from tenants.models import Pool, Tenant

DEFAULT_TRITON_MODEL = "kvgate_llm"
DEFAULT_OFFLOAD_MIN_PRIORITY = 35

_VALIDATORS: dict[str, Any] = {
    "name": lambda x: v.name(x, field="name"),
    "model_name": lambda x: v.text(x, field="model_name", max_len=128),
    "triton_url": lambda x: v.text(x, field="triton_url", max_len=256),
    "triton_model": lambda x: v.text(x, field="triton_model", max_len=128),
    "engine_spec": lambda x: v.text(x, field="engine_spec", max_len=128, allow_empty=True),
    "tokens_per_block": lambda x: v.integer(x, field="tokens_per_block", minimum=1, maximum=4096),
    "primary_blocks": lambda x: v.integer(x, field="primary_blocks", minimum=1),
    "secondary_blocks": lambda x: v.integer(x, field="secondary_blocks", minimum=0),
    "secondary_offload_min_priority": lambda x: v.priority(x, field="secondary_offload_min_priority"),
}
UPDATABLE = frozenset(_VALIDATORS)


def _validated(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _VALIDATORS:
            raise InvalidField(f"unknown or read-only field {key!r}", field=key)
        out[key] = _VALIDATORS[key](value)
    return out


def create_pool(
    session: Session,
    *,
    actor: str,
    now: datetime,
    name: str,
    model_name: str,
    triton_url: str,
    primary_blocks: int,
    tokens_per_block: int = 32,
    secondary_blocks: int = 0,
    secondary_offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
    triton_model: str = DEFAULT_TRITON_MODEL,
    engine_spec: str = "",
) -> Pool:
    values = _validated(
        dict(
            name=name,
            model_name=model_name,
            triton_url=triton_url,
            triton_model=triton_model,
            engine_spec=engine_spec,
            tokens_per_block=tokens_per_block,
            primary_blocks=primary_blocks,
            secondary_blocks=secondary_blocks,
            secondary_offload_min_priority=secondary_offload_min_priority,
        )
    )
    with mutation(session, unique_field="name", entity="pool"):
        pool = audit.audited_insert(session, Pool(**values, created_at=now, updated_at=now, version=1),
                                    actor=actor, now=now, entity_type="pool")
    return pool


def get_pool(session: Session, *, ref: int | str) -> Pool:
    return get_by_ref(session, Pool, ref, name_attr="name", what="pool")


def list_pools(session: Session, *, limit: int = 50, offset: int = 0) -> Page[Pool]:
    return paginate(session, select(Pool).order_by(Pool.id), limit=limit, offset=offset)


def update_pool(
    session: Session, *, actor: str, now: datetime, ref: int | str, version: int, changes: Mapping[str, Any]
) -> Pool:
    """Apply ``changes`` (any of ``UPDATABLE``) if ``version`` is current."""
    values = _validated(changes)
    with mutation(session, unique_field="name", entity="pool"):
        pool = get_pool(session, ref=ref)
        check_version(pool, version)
        audit.audited_update(session, pool, actor=actor, now=now, entity_type="pool", version=version, values=values)
    return pool


def delete_pool(session: Session, *, actor: str, now: datetime, ref: int | str) -> None:
    with mutation(session, entity="pool"):
        pool = get_pool(session, ref=ref)
        users = session.scalar(select(func.count()).select_from(Tenant).where(Tenant.pool_id == pool.id)) or 0
        if users:
            raise InUse(
                f"pool {pool.name!r} is used by {users} tenant(s); move or delete them first", code="pool_in_use"
            )
        audit.audited_delete(session, pool, actor=actor, now=now, entity_type="pool")
