"""Pools: engine deployments tenants are placed on.

Every mutation is one transaction with one audit event (``entity_type="pool"``; its
before/after views list the pool's replicas). Deleting a pool that tenants still use
raises ``InUse``; deleting a pool deletes its replicas, SLO budget and trace captures
(``ON DELETE CASCADE``), each budget and capture with its own delete event.

A pool is created with ``replicas=[{name, endpoint, weight?, state?}, ...]`` (at least
one), or, for callers written before replicas existed, with the legacy
``triton_url="host:port"``, which means exactly one replica ``r0`` (active, weight 1).
Giving both, or neither, is an error on ``replicas``. After creation, replicas are
managed through ``tenants.replicas``; ``triton_url`` is no longer a pool field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tenants import audit, captures
from tenants import validation as v
from tenants.common import Page, check_version, get_by_ref, mutation, paginate, snapshot
from tenants.errors import InUse, InvalidField
from tenants.models import Pool, PoolReplica, PoolSloBudget, Tenant, TraceCapture
from tenants.replicas import MAX_REPLICAS, validated_replica

DEFAULT_TRITON_MODEL = "kvgate_llm"
DEFAULT_OFFLOAD_MIN_PRIORITY = 35

_VALIDATORS: dict[str, Any] = {
    "name": lambda x: v.name(x, field="name"),
    "model_name": lambda x: v.text(x, field="model_name", max_len=128),
    "triton_model": lambda x: v.text(x, field="triton_model", max_len=128),
    "engine_spec": lambda x: v.text(x, field="engine_spec", max_len=128, allow_empty=True),
    "tokens_per_block": lambda x: v.integer(x, field="tokens_per_block", minimum=1, maximum=4096),
    "primary_blocks": lambda x: v.integer(x, field="primary_blocks", minimum=1),
    "secondary_blocks": lambda x: v.integer(x, field="secondary_blocks", minimum=0),
    "secondary_offload_min_priority": lambda x: v.priority(x, field="secondary_offload_min_priority"),
}
UPDATABLE = frozenset(_VALIDATORS)
LEGACY_REPLICA_NAME = "r0"


def audit_view(pool: Pool) -> dict[str, Any]:
    """The pool's columns plus its replicas (ordered by id), for audit before/after."""
    return {**snapshot(pool), "replicas": [snapshot(r) for r in pool.replicas]}


def initial_replicas(
    *, replicas: Sequence[Mapping[str, Any]] | None, triton_url: str | None
) -> list[dict[str, Any]]:
    """Validated replica values for a new pool, from ``replicas`` or the legacy ``triton_url``."""
    if replicas is not None and triton_url is not None:
        raise InvalidField("give replicas or the legacy triton_url, not both", field="replicas")
    if replicas is None:
        if triton_url is None:
            raise InvalidField("a pool needs at least one replica (replicas, or the legacy triton_url)",
                               field="replicas")
        return [validated_replica({"name": LEGACY_REPLICA_NAME, "endpoint": v.endpoint(triton_url, field="triton_url")})]
    if isinstance(replicas, (str, bytes, Mapping)) or not isinstance(replicas, Sequence) or not replicas:
        raise InvalidField("replicas must be a non-empty list", field="replicas")
    if len(replicas) > MAX_REPLICAS:
        raise InvalidField(f"at most {MAX_REPLICAS} replicas per pool", field="replicas")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, spec in enumerate(replicas):
        values = validated_replica(spec, prefix=f"replicas.{i}.")
        if values["name"] in seen:
            raise InvalidField(f"replica name {values['name']!r} appears twice", field=f"replicas.{i}.name")
        seen.add(values["name"])
        out.append(values)
    return out


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
    primary_blocks: int,
    replicas: Sequence[Mapping[str, Any]] | None = None,
    triton_url: str | None = None,
    tokens_per_block: int = 32,
    secondary_blocks: int = 0,
    secondary_offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY,
    triton_model: str = DEFAULT_TRITON_MODEL,
    engine_spec: str = "",
) -> Pool:
    """Create a pool with its replicas (or the legacy ``triton_url`` = one replica ``r0``)."""
    replica_values = initial_replicas(replicas=replicas, triton_url=triton_url)
    values = _validated(
        dict(
            name=name,
            model_name=model_name,
            triton_model=triton_model,
            engine_spec=engine_spec,
            tokens_per_block=tokens_per_block,
            primary_blocks=primary_blocks,
            secondary_blocks=secondary_blocks,
            secondary_offload_min_priority=secondary_offload_min_priority,
        )
    )
    with mutation(session, unique_field="name", entity="pool"):
        members = [PoolReplica(**r, created_at=now, updated_at=now, version=1) for r in replica_values]
        pool = audit.audited_insert(
            session, Pool(**values, replicas=members, created_at=now, updated_at=now, version=1),
            actor=actor, now=now, entity_type="pool", view=audit_view,
        )
    return pool


def get_pool(session: Session, *, ref: int | str) -> Pool:
    return get_by_ref(session, Pool, ref, name_attr="name", what="pool")


def list_pools(session: Session, *, limit: int = 50, offset: int = 0) -> Page[Pool]:
    """Pools ordered by id, each with its replicas loaded."""
    return paginate(session, select(Pool).order_by(Pool.id), limit=limit, offset=offset)


def update_pool(
    session: Session, *, actor: str, now: datetime, ref: int | str, version: int, changes: Mapping[str, Any]
) -> Pool:
    """Apply ``changes`` (any of ``UPDATABLE``; replicas change through ``tenants.replicas``)."""
    if "triton_url" in changes:
        raise InvalidField("triton_url is no longer a pool field; change the pool's replicas instead",
                           field="triton_url")
    values = _validated(changes)
    with mutation(session, unique_field="name", entity="pool"):
        pool = get_pool(session, ref=ref)
        check_version(pool, version)
        audit.audited_update(session, pool, actor=actor, now=now, entity_type="pool", version=version, values=values,
                             view=audit_view)
    return pool


def delete_pool(session: Session, *, actor: str, now: datetime, ref: int | str) -> None:
    """Delete a pool with its replicas, SLO budget and trace captures (FK ``CASCADE``; audit events
    stay). Records ``trace_capture.delete`` per capture (an active one stops with it), then
    ``pool_slo.delete`` when it had a budget, then ``pool.delete`` (its view lists the replicas),
    all in one transaction; 409 ``pool_in_use`` while a tenant is placed on it."""
    with mutation(session, entity="pool"):
        pool = get_pool(session, ref=ref)
        if session.get_bind().dialect.name == "postgresql":
            # Held to the end: a capture or budget added meanwhile (its FK insert waits on this
            # row) cannot slip into the cascade without its event.
            session.execute(select(Pool.id).where(Pool.id == pool.id).with_for_update())
        users = session.scalar(select(func.count()).select_from(Tenant).where(Tenant.pool_id == pool.id)) or 0
        if users:
            raise InUse(
                f"pool {pool.name!r} is used by {users} tenant(s); move or delete them first", code="pool_in_use"
            )
        fresh = {"populate_existing": True}  # as of the lock, not of get_pool's read
        for capture in session.scalars(select(TraceCapture).where(TraceCapture.pool_id == pool.id)
                                       .order_by(TraceCapture.id).execution_options(**fresh)):
            audit.record(session, actor=actor, action="trace_capture.delete", entity_type="trace_capture",
                         entity_id=capture.id, before=captures.audit_view(capture), after=None, now=now)
        budget = session.scalars(select(PoolSloBudget).where(PoolSloBudget.pool_id == pool.id)
                                 .execution_options(**fresh)).one_or_none()
        if budget is not None:  # the event tenants.slo.delete_budget records (that module imports this one)
            audit.record(session, actor=actor, action="pool_slo.delete", entity_type="pool_slo", entity_id=pool.id,
                         before=snapshot(budget), after=None, now=now)
        audit.audited_delete(session, pool, actor=actor, now=now, entity_type="pool", view=audit_view)
