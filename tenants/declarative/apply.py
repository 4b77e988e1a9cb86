"""Apply a plan: every change through the registry's own services, all in one transaction.

Each change is one service call, so it is validated by the same rules and writes exactly
one audit event as ``actor``; ``tenants.common.batch`` makes the whole plan commit at once
or not at all (a failing change rolls back the ones before it).

Dedication (a ``dedicated`` tenant is alone on its pool) is checked on the end state:
``tenant.update_tenant`` checks each move right after writing it, which refuses a swap of
two dedicated tenants in any order. So a tenant update that moves it (``pool`` or
``isolation``) runs with ``check_dedication=False``, and once every change is written the
service's own check (``tenant.check_placement``) runs for each moved tenant, in the same
transaction (on PostgreSQL the pools they took stay locked until the commit): an end state
that breaks dedication is still refused, writing nothing.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from tenants import pools, replicas, retention_classes, slo, tenant
from tenants.common import batch
from tenants.declarative.plan import Change, Plan, compute_plan
from tenants.declarative.schema import RegistryFile

PLACEMENT = ("pool", "isolation")  # the tenant fields whose change places it (tenants.tenant._check_dedication)


def _moves(change: Change) -> bool:
    return change.kind == "tenant" and change.action == "update" and any(k in change.payload for k in PLACEMENT)


def _check_moved(session: Session, refs: list[str]) -> None:
    """The service's dedication check, on the end state, for every tenant the plan moved."""
    for ref in refs:  # inside the batch: a refusal rolls every change back
        tenant.check_placement(session, tenant.get_tenant(session, ref=ref))


def _execute(session: Session, change: Change, *, actor: str, now: datetime) -> None:
    kw = {"actor": actor, "now": now}
    p = change.payload
    match (change.kind, change.action):
        case ("retention_class", "create"):
            retention_classes.create_class(session, **kw, **p)
        case ("retention_class", "update"):
            retention_classes.update_class(session, **kw, ref=change.ref, version=change.version, changes=p)
        case ("retention_class", "delete"):
            retention_classes.delete_class(session, **kw, ref=change.ref)
        case ("pool", "create"):
            pools.create_pool(session, **kw, **p)
        case ("pool", "update"):
            pools.update_pool(session, **kw, ref=change.ref, version=change.version, changes=p)
        case ("pool", "delete"):
            pools.delete_pool(session, **kw, ref=change.ref)
        case ("replica", "create"):
            replicas.add_replica(session, **kw, **p)
        case ("replica", "update"):
            replicas.update_replica(session, **kw, pool=p["pool"], name=p["name"], version=change.version,
                                    changes=p["changes"])
        case ("pool_slo", "create") | ("pool_slo", "update"):
            slo.set_budget(session, **kw, pool=change.ref, values=p, version=change.version)
        case ("pool_slo", "delete"):
            slo.delete_budget(session, **kw, pool=change.ref)
        case ("replica", "delete"):
            replicas.remove_replica(session, **kw, pool=p["pool"], name=p["name"])
        case ("tenant", "create"):
            tenant.create_tenant(session, **kw, **p)
        case ("tenant", "update"):  # a move's dedication is checked on the end state (_check_moved)
            tenant.update_tenant(session, **kw, ref=change.ref, version=change.version, changes=p,
                                 check_dedication=not _moves(change))
        case ("tenant", "suspend"):
            tenant.suspend_tenant(session, **kw, ref=change.ref)
        case ("tenant", "resume"):
            tenant.resume_tenant(session, **kw, ref=change.ref)
        case ("tenant", "delete"):
            tenant.delete_tenant(session, **kw, ref=change.ref)
        case _:  # pragma: no cover - compute_plan only emits the cases above
            raise AssertionError(f"unknown change {change.kind} {change.action}")


def apply_plan(session: Session, plan: Plan, *, actor: str, now: datetime) -> None:
    """Run every change of ``plan`` in one transaction (nothing at all for an empty plan)."""
    if plan.empty:
        return
    with batch(session):
        for change in plan.changes:
            _execute(session, change, actor=actor, now=now)
        _check_moved(session, [c.ref for c in plan.changes if _moves(c)])


def apply_registry(
    session: Session, doc: RegistryFile, *, actor: str, now: datetime, prune: bool = False, dry_run: bool = False
) -> Plan:
    """Plan ``doc`` against the registry and, unless ``dry_run``, apply it. Returns the plan."""
    plan = compute_plan(session, doc, prune=prune)
    if dry_run:
        session.rollback()  # end the read transaction; nothing was written
    else:
        apply_plan(session, plan, actor=actor, now=now)
    return plan
