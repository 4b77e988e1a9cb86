"""The diff between a registry file and the registry: an ordered list of changes.

Rules (what ``kvgate admin apply`` promises):

* Only what the file writes is managed. A field omitted from an item is left as it is
  (on create, the services' defaults apply); e.g. a replica without ``state`` keeps the
  state an operator gave it with ``kvgate admin replicas drain``.
* A pool's ``slo`` is its whole SLO budget: omitted, the budget is not managed (even with
  ``prune``: a budget set with ``kvgate admin slo set`` survives a file that never names
  budgets); ``slo: null`` means "no budget", as ``null`` means "none" for the other
  fields that may be empty (``limit_caps``, ``turn_duration_ms``): a budget the pool has is
  deleted (``pool_slo`` delete, audited as ``kvgate admin slo delete`` is), without ``prune``.
* Entities absent from the file are left alone, unless ``prune``: then pools, replicas
  of a listed pool, retention classes and tenants that the file does not list are
  deleted — but only for the kinds whose list appears in the file (a file without
  ``tenants:`` never deletes a tenant). Pruning a tenant deletes, with it, its API keys,
  usage history, stored responses and trace captures: its line in the plan counts them.
  A prune that would leave a scoped admin credential (a tenant-admin) that is not revoked
  with no tenant at all is refused (``Conflict``, code ``prune_orphans_credential``),
  writing nothing: revoke the credential first, or keep one of its tenants in the file.
* The plan is computed from the registry as read in the caller's session; it holds the
  versions it read, so applying it after someone else changed a row fails with
  ``stale_version`` instead of overwriting their change.
* The order of the changes is the order they run in, chosen so that no end state the
  registry's rules allow is refused for the order of its steps: a pool's replica adds and removes are sequenced so
  it never has more than ``MAX_REPLICAS`` nor none (renaming a replica works at the maximum
  and for a pool's only one); tenants are deleted, then updated, then created, so a pool is
  vacated before it is taken; and dedication is checked on the end state (``apply.py``), so
  dedicated tenants may swap pools.
* An empty plan means the registry already matches: applying it writes nothing. Values are
  compared as the services store them (``limit_caps: {}`` is stored as no caps, NULL), so a
  file the registry matches always plans nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tenants import slo
from tenants.declarative.schema import RegistryFile
from tenants.errors import Conflict, InvalidField
from tenants.models import (
    AdminCredential,
    AdminCredentialTenant,
    ApiKey,
    Pool,
    RetentionClass,
    StoredResponse,
    Tenant,
    TraceCapture,
    Usage,
)
from tenants.replicas import MAX_REPLICAS
from tenants.tenant import normalized_caps

# Execution order: creations bottom-up (classes, pools, replicas, tenants); pools and classes
# deleted last, once no tenant uses them. A pool's replica creates and deletes are one step,
# in the order ``_replica_steps`` gives them; tenants are deleted, then moved, then created,
# so that a pool is vacated before it is taken (see the module rules).
ORDER = (
    ("retention_class", "create"), ("retention_class", "update"),
    ("pool", "create"), ("pool", "update"),
    ("replica", "create"), ("replica", "update"),
    ("pool_slo", "create"), ("pool_slo", "update"), ("pool_slo", "delete"),
    ("tenant", "delete"), ("tenant", "update"), ("tenant", "create"), ("tenant", "suspend"), ("tenant", "resume"),
    ("pool", "delete"), ("retention_class", "delete"),
)
SAME_STEP = {("replica", "delete"): ("replica", "create")}
SYMBOL = {"create": "+", "update": "~", "suspend": "~", "resume": "~", "delete": "-"}
TENANT_LIMITS = ("rpm_limit", "tpm_limit", "max_concurrent_requests", "max_prompt_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class FieldChange:
    name: str
    old: Any  # None on create
    new: Any  # None on delete


@dataclass(frozen=True, slots=True)
class Change:
    """One registry write = one audit event. ``ref`` is ``name``, or ``pool/replica``."""

    kind: str
    action: str
    ref: str
    fields: tuple[FieldChange, ...] = ()
    version: int | None = None
    payload: dict[str, Any] = field(default_factory=dict)

    def render(self) -> list[str]:
        suffix = f" ({self.action})" if self.action in ("suspend", "resume") else ""
        lines = [f"{SYMBOL[self.action]} {self.kind} {self.ref}{suffix}"]
        for f in self.fields:
            if self.action == "create":
                lines.append(f"    {f.name}: {_show(f.new)}")
            elif self.action == "delete":
                lines.append(f"    {f.name}: {_show(f.old)}")
            else:
                lines.append(f"    {f.name}: {_show(f.old)} → {_show(f.new)}")
        return lines


@dataclass(frozen=True, slots=True)
class Plan:
    changes: tuple[Change, ...]

    @property
    def empty(self) -> bool:
        return not self.changes

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.changes:
            out[c.action] = out.get(c.action, 0) + 1
        return out

    def render(self) -> str:
        if self.empty:
            return "no changes: the registry matches the file"
        lines = [line for c in self.changes for line in c.render()]
        summary = ", ".join(f"{n} {a}" for a, n in sorted(self.counts().items()))
        return "\n".join([*lines, f"{len(self.changes)} change(s): {summary}"])


def _show(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _diff(current: Any, wanted: dict[str, Any]) -> tuple[FieldChange, ...]:
    return tuple(
        FieldChange(k, getattr(current, k), v) for k, v in sorted(wanted.items()) if getattr(current, k) != v
    )


def _created(values: dict[str, Any]) -> tuple[FieldChange, ...]:
    return tuple(FieldChange(k, None, v) for k, v in sorted(values.items()))


def _replica_steps(count: int, creates: list[Change], deletes: list[Change]) -> list[Change]:
    """One pool's replica creates and deletes, ordered so that it never holds more than
    ``MAX_REPLICAS`` (a create at the maximum waits for a delete) nor none (the deletes left
    over run after the creates). ``count`` is the pool's replicas before the plan."""
    out: list[Change] = []
    pending = list(deletes)
    for create in creates:
        if count >= MAX_REPLICAS and pending:
            out.append(pending.pop(0))
            count -= 1
        out.append(create)
        count += 1
    return out + pending


def _replica_line(r: dict[str, Any]) -> str:
    return f"{r['name']}={r['endpoint']}" + "".join(
        f" {k}={r[k]}" for k in ("weight", "state") if k in r
    )


# What deleting a tenant deletes with it (ON DELETE CASCADE): plan field -> (table, tenant column).
CASCADED = (
    ("api_keys", ApiKey, ApiKey.tenant_id),
    ("usage_minutes", Usage, Usage.tenant_id),
    ("stored_responses", StoredResponse, StoredResponse.tenant_id),
    ("trace_captures", TraceCapture, TraceCapture.tenant_id),
)


def _cascaded(session: Session, tenant_ids: list[int]) -> dict[int, tuple[FieldChange, ...]]:
    """Per pruned tenant, the rows its deletion takes along, as plan lines (``api_keys: 2``);
    a trace capture line only when it has some."""
    counts = {
        name: dict(session.execute(select(column, func.count()).select_from(model)
                                   .where(column.in_(tenant_ids)).group_by(column)).all())
        for name, model, column in CASCADED
    }
    return {tid: tuple(FieldChange(name, counts[name].get(tid, 0), None) for name, _, _ in CASCADED
                       if name != "trace_captures" or counts[name].get(tid, 0)) for tid in tenant_ids}


def _refuse_orphaned_credentials(session: Session, pruned: dict[int, str]) -> None:
    """Refuse a prune after which a scoped credential that is not revoked has no tenant left
    (its scope rows go with the tenants; it would stay valid and manage nothing)."""
    touched = select(AdminCredentialTenant.credential_id).where(AdminCredentialTenant.tenant_id.in_(list(pruned)))
    rows = session.execute(
        select(AdminCredential.id, AdminCredential.name, AdminCredential.role, AdminCredentialTenant.tenant_id)
        .join(AdminCredentialTenant, AdminCredentialTenant.credential_id == AdminCredential.id)
        .where(AdminCredential.id.in_(touched), AdminCredential.revoked_at.is_(None))
        .order_by(AdminCredential.id)
    ).all()
    scopes: dict[tuple[int, str, str], set[int]] = {}
    for cred_id, name, role, tenant_id in rows:
        scopes.setdefault((cred_id, name, role), set()).add(tenant_id)
    orphaned = [(cred_id, name, role, sorted(pruned[t] for t in scope))
                for (cred_id, name, role), scope in scopes.items() if scope <= pruned.keys()]
    if orphaned:
        listed = "; ".join(f"{name!r} (id {cred_id}, {role}, tenants {', '.join(slugs)})"
                           for cred_id, name, role, slugs in orphaned)
        raise Conflict(
            f"--prune would delete every tenant of admin credential(s) {listed}, leaving them valid with no tenant; "
            "nothing was changed. Revoke them first (kvgate admin credentials revoke <id>), or keep one of their "
            "tenants in the file", field="tenants", code="prune_orphans_credential")


def compute_plan(session: Session, doc: RegistryFile, *, prune: bool = False) -> Plan:
    """The changes that make the registry match ``doc`` (see the module rules)."""
    pools = {p.name: p for p in session.scalars(select(Pool).order_by(Pool.id))}
    pool_names = {p.id: p.name for p in pools.values()}
    classes = {c.name: c for c in session.scalars(select(RetentionClass).order_by(RetentionClass.id))}
    class_names = {c.id: c.name for c in classes.values()}
    tenants = {t.slug: t for t in session.scalars(select(Tenant).order_by(Tenant.id))}
    changes: list[Change] = []

    for spec in doc.retention_classes or []:
        cur = classes.get(spec.name)
        wanted = spec.given(exclude=("name",))
        if cur is None:
            changes.append(Change("retention_class", "create", spec.name, _created(wanted), payload=spec.given()))
        elif diff := _diff(cur, wanted):
            changes.append(Change("retention_class", "update", spec.name, diff, cur.version,
                                  {f.name: f.new for f in diff}))

    for spec in doc.pools or []:
        cur = pools.get(spec.name)
        wanted = spec.given(exclude=("name", "replicas", "slo"))
        replicas = [r.given() for r in spec.replicas]
        have = None if cur is None else cur.slo
        if spec.slo is not None:  # the whole budget, defaults for what the file leaves out
            budget = slo.validated(spec.slo.model_dump())
            if have is None:
                changes.append(Change("pool_slo", "create", spec.name, _created(budget), payload=budget))
            elif diff := _diff(have, budget):
                changes.append(Change("pool_slo", "update", spec.name, diff, have.version, budget))
        elif "slo" in spec.model_fields_set and have is not None:  # `slo: null`: no budget (omitted: unmanaged)
            changes.append(Change("pool_slo", "delete", spec.name,
                                  tuple(FieldChange(k, getattr(have, k), None) for k in slo.DEFAULTS), have.version))
        if cur is None:
            fields = (*_created(wanted), FieldChange("replicas", None, [_replica_line(r) for r in replicas]))
            changes.append(Change("pool", "create", spec.name, fields,
                                  payload={**spec.given(exclude=("replicas", "slo")), "replicas": replicas}))
            continue
        if diff := _diff(cur, wanted):
            changes.append(Change("pool", "update", spec.name, diff, cur.version, {f.name: f.new for f in diff}))
        existing = {r.name: r for r in cur.replicas}
        creates: list[Change] = []
        deletes: list[Change] = []
        for r in spec.replicas:
            ref = f"{spec.name}/{r.name}"
            replica = existing.get(r.name)
            if replica is None:
                creates.append(Change("replica", "create", ref, _created(r.given(exclude=("name",))),
                                      payload={"pool": spec.name, **r.given()}))
            elif diff := _diff(replica, r.given(exclude=("name",))):
                changes.append(Change("replica", "update", ref, diff, replica.version,
                                      {"pool": spec.name, "name": r.name, "changes": {f.name: f.new for f in diff}}))
        if prune:
            listed = {r.name for r in spec.replicas}
            deletes = [Change("replica", "delete", f"{spec.name}/{name}", (FieldChange("endpoint", row.endpoint, None),),
                              payload={"pool": spec.name, "name": name})
                       for name, row in existing.items() if name not in listed]
        changes += _replica_steps(len(existing), creates, deletes)

    prune_pools = prune and doc.pools is not None
    prune_classes = prune and doc.retention_classes is not None
    known_pools = {p.name for p in doc.pools or []} | (set() if prune_pools else set(pools))
    known_classes = {c.name for c in doc.retention_classes or []} | (set() if prune_classes else set(classes))
    for i, spec in enumerate(doc.tenants or []):
        for attr, known, what in (("pool", known_pools, "pool"), ("retention_class", known_classes, "retention class")):
            ref = getattr(spec, attr)
            if ref not in known:
                gone = " (it exists in the registry but --prune would delete it)" if ref in pools or ref in classes \
                    else ""
                raise InvalidField(f"tenants[{i}].{attr}: {what} {ref!r} is neither in the file nor in the registry"
                                   f"{gone}", field=f"tenants[{i}].{attr}", code=f"unknown_{attr}")
        cur = tenants.get(spec.slug)
        wanted = spec.given(exclude=("slug", "status"))
        if "limit_caps" in wanted:  # as the service stores them: {} (or only null caps) is NULL
            wanted["limit_caps"] = normalized_caps(wanted["limit_caps"])
        if cur is None:
            wanted.setdefault("display_name", spec.slug)
            changes.append(Change("tenant", "create", spec.slug, _created(wanted),
                                  payload={"slug": spec.slug, **wanted}))
            if spec.status == "suspended":
                changes.append(Change("tenant", "suspend", spec.slug, (FieldChange("status", "active", "suspended"),)))
            continue
        current = {k: getattr(cur, k) for k in wanted if k not in ("pool", "retention_class")}
        current["pool"] = pool_names.get(cur.pool_id)
        current["retention_class"] = class_names.get(cur.retention_class_id)
        diff = tuple(FieldChange(k, current[k], v) for k, v in sorted(wanted.items()) if current[k] != v)
        if diff:
            changes.append(Change("tenant", "update", spec.slug, diff, cur.version, {f.name: f.new for f in diff}))
        if spec.status is not None and spec.status != cur.status:
            action = "suspend" if spec.status == "suspended" else "resume"
            changes.append(Change("tenant", action, spec.slug, (FieldChange("status", cur.status, spec.status),)))

    if prune and doc.tenants is not None:
        listed = {t.slug for t in doc.tenants}
        pruned = {t.id: slug for slug, t in tenants.items() if slug not in listed}
        if pruned:
            _refuse_orphaned_credentials(session, pruned)
            cascaded = _cascaded(session, list(pruned))
            changes += [Change("tenant", "delete", slug, (FieldChange("pool", pool_names.get(tenants[slug].pool_id),
                                                                      None), *cascaded[tid]))
                        for tid, slug in pruned.items()]
    if prune_pools:
        listed = {p.name for p in doc.pools or []}
        changes += [Change("pool", "delete", name, (FieldChange("replicas", [r.name for r in p.replicas], None),))
                    for name, p in pools.items() if name not in listed]
    if prune_classes:
        listed = {c.name for c in doc.retention_classes or []}
        changes += [Change("retention_class", "delete", name) for name in classes if name not in listed]

    rank = {key: i for i, key in enumerate(ORDER)}
    rank.update({key: rank[step] for key, step in SAME_STEP.items()})
    return Plan(tuple(sorted(changes, key=lambda c: rank[(c.kind, c.action)])))  # stable: file order within a step
