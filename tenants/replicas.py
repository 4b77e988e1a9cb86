"""Pool replicas: the engine endpoints (Triton or reference server) that serve a pool.

Invariants:

* A pool keeps at least one replica: removing its last one raises ``Conflict``
  (``last_replica``, 409). Draining or disabling the last one is allowed (the pool then
  has no active replica; the gateway's legacy ``triton_url`` falls back to the first).
* Names are unique within a pool (``uq_pool_replicas_pool_id_name``) and follow the
  registry's name rule; endpoints are ``host:port``; weight >= 1; state is one of
  ``active | draining | disabled``.
* Every mutation is one transaction with one audit event (``entity_type="pool_replica"``,
  actions ``pool_replica.create|update|drain|disable|activate|delete``). A state change
  to the state the replica already has changes nothing and records nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tenants import audit
from tenants import validation as v
from tenants.common import check_version, get_by_ref, mutation, snapshot
from tenants.errors import Conflict, InvalidField, NotFound
from tenants.models import Pool, PoolReplica

DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1000
MAX_REPLICAS = 256  # per pool: at creation (tenants.pools) and for every replica added after
UPDATABLE = frozenset({"endpoint", "weight", "state"})
STATE_ACTIONS = {"draining": "pool_replica.drain", "disabled": "pool_replica.disable", "active": "pool_replica.activate"}

_VALIDATORS: dict[str, Any] = {
    "name": lambda x, f: v.name(x, field=f),
    "endpoint": lambda x, f: v.endpoint(x, field=f),
    "weight": lambda x, f: v.integer(x, field=f, minimum=1, maximum=MAX_WEIGHT),
    "state": lambda x, f: v.replica_state(x, field=f),
}


def validated_replica(values: Mapping[str, Any], *, prefix: str = "", partial: bool = False) -> dict[str, Any]:
    """Checked replica fields; error fields are ``prefix + key`` (e.g. ``replicas.1.endpoint``).

    Unless ``partial``, ``name`` and ``endpoint`` are required and ``weight``/``state``
    default to 1 / ``active``.
    """
    if not isinstance(values, Mapping):
        raise InvalidField("a replica must be an object with name and endpoint", field=prefix.rstrip(".") or None)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in _VALIDATORS:
            raise InvalidField(f"unknown or read-only replica field {key!r}", field=f"{prefix}{key}")
        out[key] = _VALIDATORS[key](value, f"{prefix}{key}")
    if not partial:
        for key in ("name", "endpoint"):
            if key not in out:
                raise InvalidField(f"a replica needs a {key}", field=f"{prefix}{key}")
        out.setdefault("weight", DEFAULT_WEIGHT)
        out.setdefault("state", "active")
    return out


def audit_view(replica: PoolReplica) -> dict[str, Any]:
    return snapshot(replica)


def _pool(session: Session, pool: int | str, *, lock: bool = False) -> Pool:
    row = get_by_ref(session, Pool, pool, name_attr="name", what="pool")
    if lock and session.get_bind().dialect.name == "postgresql":
        # Serialise replica removals per pool (the "keep one" check); SQLite's write lock does it there.
        session.execute(select(Pool.id).where(Pool.id == row.id).with_for_update())
    return row


def _find(session: Session, pool: Pool, name: Any) -> PoolReplica:
    row = None
    if isinstance(name, str) and v.NAME_RE.match(name):
        row = session.scalars(
            select(PoolReplica).where(PoolReplica.pool_id == pool.id, PoolReplica.name == name)
        ).one_or_none()
    if row is None:
        raise NotFound(f"pool {pool.name!r} has no replica {str(name)[:80]!r}", code="replica_not_found")
    return row


def list_replicas(session: Session, *, pool: int | str) -> list[PoolReplica]:
    """The pool's replicas, ordered by id (the first is the pool's oldest)."""
    row = _pool(session, pool)
    return list(session.scalars(select(PoolReplica).where(PoolReplica.pool_id == row.id).order_by(PoolReplica.id)))


def get_replica(session: Session, *, pool: int | str, name: str) -> PoolReplica:
    return _find(session, _pool(session, pool), name)


def add_replica(
    session: Session,
    *,
    actor: str,
    now: datetime,
    pool: int | str,
    name: str,
    endpoint: str,
    weight: int = DEFAULT_WEIGHT,
    state: str = "active",
) -> PoolReplica:
    """Add a replica; refuses (409 ``too_many_replicas``) a pool's ``MAX_REPLICAS + 1``-th."""
    values = validated_replica(dict(name=name, endpoint=endpoint, weight=weight, state=state))
    with mutation(session, unique_field="name", entity="replica"):
        pool_row = _pool(session, pool, lock=True)
        replica = PoolReplica(pool_id=pool_row.id, **values, created_at=now, updated_at=now, version=1)
        audit.audited_insert(session, replica, actor=actor, now=now, entity_type="pool_replica", view=audit_view)
        # Counted after the INSERT, in the write transaction (FOR UPDATE on PostgreSQL), like remove_replica.
        count = session.scalar(select(func.count()).select_from(PoolReplica).where(PoolReplica.pool_id == pool_row.id))
        if (count or 0) > MAX_REPLICAS:
            raise Conflict(f"pool {pool_row.name!r} already has {MAX_REPLICAS} replicas, the most a pool may have; "
                           "remove one first", field="name", code="too_many_replicas")
    session.expire(pool_row, ["replicas"])
    return replica


def update_replica(
    session: Session,
    *,
    actor: str,
    now: datetime,
    pool: int | str,
    name: str,
    version: int,
    changes: Mapping[str, Any],
) -> PoolReplica:
    """Change ``endpoint``, ``weight`` and/or ``state`` if ``version`` is current."""
    for key in changes:
        if key not in UPDATABLE:
            raise InvalidField(f"unknown or read-only replica field {key!r} (updatable: endpoint, weight, state)",
                               field=key)
    values = validated_replica(changes, partial=True)
    with mutation(session, entity="replica"):
        replica = _find(session, _pool(session, pool), name)
        check_version(replica, version)
        audit.audited_update(session, replica, actor=actor, now=now, entity_type="pool_replica", version=version,
                             values=values, view=audit_view)
    return replica


def set_state(
    session: Session, *, actor: str, now: datetime, pool: int | str, name: str, state: str, version: int | None = None
) -> PoolReplica:
    """Move a replica to ``state`` (``version`` optional); a no-op records nothing."""
    state = v.replica_state(state)
    with mutation(session, entity="replica"):
        replica = _find(session, _pool(session, pool), name)
        expected = replica.version if version is None else check_version(replica, version)
        if replica.state == state:
            return replica
        audit.audited_update(session, replica, actor=actor, now=now, entity_type="pool_replica", version=expected,
                             values={"state": state}, view=audit_view, action=STATE_ACTIONS[state])
    return replica


def drain_replica(session: Session, *, actor: str, now: datetime, pool: int | str, name: str,
                  version: int | None = None) -> PoolReplica:
    """No new requests; in-flight ones finish (the gateway's side of the contract)."""
    return set_state(session, actor=actor, now=now, pool=pool, name=name, state="draining", version=version)


def disable_replica(session: Session, *, actor: str, now: datetime, pool: int | str, name: str,
                    version: int | None = None) -> PoolReplica:
    return set_state(session, actor=actor, now=now, pool=pool, name=name, state="disabled", version=version)


def activate_replica(session: Session, *, actor: str, now: datetime, pool: int | str, name: str,
                     version: int | None = None) -> PoolReplica:
    return set_state(session, actor=actor, now=now, pool=pool, name=name, state="active", version=version)


def remove_replica(session: Session, *, actor: str, now: datetime, pool: int | str, name: str) -> None:
    """Delete a replica; refuses (409 ``last_replica``) to leave the pool with none."""
    with mutation(session, entity="replica"):
        pool_row = _pool(session, pool, lock=True)
        replica = _find(session, pool_row, name)
        audit.audited_delete(session, replica, actor=actor, now=now, entity_type="pool_replica", view=audit_view)
        # Counted after the DELETE: inside the write transaction, so two concurrent removals
        # of a pool's last two replicas cannot both see one left (FOR UPDATE on PostgreSQL).
        left = session.scalar(select(func.count()).select_from(PoolReplica).where(PoolReplica.pool_id == pool_row.id))
        if not left:
            raise Conflict(
                f"replica {name!r} is the last replica of pool {pool_row.name!r}; a pool needs at least one "
                "(add another first, or delete the pool)",
                field="name",
                code="last_replica",
            )
    session.expire(pool_row, ["replicas"])
