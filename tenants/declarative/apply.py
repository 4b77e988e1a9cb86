"""Apply a plan: every change through the registry's own services, all in one transaction.

Each change is one service call, so it is validated by the same rules and writes exactly
one audit event as ``actor``; ``tenants.common.batch`` makes the whole plan commit at once
or not at all (a failing change rolls back the ones before it).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from tenants import pools, replicas, retention_classes, tenant
from tenants.common import batch
from tenants.declarative.plan import Change, Plan, compute_plan
from tenants.declarative.schema import RegistryFile


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
        case ("replica", "delete"):
            replicas.remove_replica(session, **kw, pool=p["pool"], name=p["name"])
        case ("tenant", "create"):
            tenant.create_tenant(session, **kw, **p)
        case ("tenant", "update"):
            tenant.update_tenant(session, **kw, ref=change.ref, version=change.version, changes=p)
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
