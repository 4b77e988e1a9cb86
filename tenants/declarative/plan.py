"""The diff between a registry file and the registry: an ordered list of changes.

Rules (what ``kvgate admin apply`` promises):

* Only what the file writes is managed. A field omitted from an item is left as it is
  (on create, the services' defaults apply); e.g. a replica without ``state`` keeps the
  state an operator gave it with ``kvgate admin replicas drain``.
* Entities absent from the file are left alone, unless ``prune``: then pools, replicas
  of a listed pool, retention classes and tenants that the file does not list are
  deleted — but only for the kinds whose list appears in the file (a file without
  ``tenants:`` never deletes a tenant). Pruning a tenant deletes its API keys.
* The plan is computed from the registry as read in the caller's session; it holds the
  versions it read, so applying it after someone else changed a row fails with
  ``stale_version`` instead of overwriting their change.
* An empty plan means the registry already matches: applying it writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenants.declarative.schema import RegistryFile
from tenants.errors import InvalidField
from tenants.models import Pool, RetentionClass, Tenant

# Execution order: creations bottom-up (classes, pools, replicas, tenants), deletions top-down.
ORDER = (
    ("retention_class", "create"), ("retention_class", "update"),
    ("pool", "create"), ("pool", "update"),
    ("replica", "create"), ("replica", "update"),
    ("tenant", "create"), ("tenant", "update"), ("tenant", "suspend"), ("tenant", "resume"),
    ("tenant", "delete"), ("replica", "delete"), ("pool", "delete"), ("retention_class", "delete"),
)
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


def _replica_line(r: dict[str, Any]) -> str:
    return f"{r['name']}={r['endpoint']}" + "".join(
        f" {k}={r[k]}" for k in ("weight", "state") if k in r
    )


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
        wanted = spec.given(exclude=("name", "replicas"))
        replicas = [r.given() for r in spec.replicas]
        if cur is None:
            fields = (*_created(wanted), FieldChange("replicas", None, [_replica_line(r) for r in replicas]))
            changes.append(Change("pool", "create", spec.name, fields,
                                  payload={**spec.given(exclude=("replicas",)), "replicas": replicas}))
            continue
        if diff := _diff(cur, wanted):
            changes.append(Change("pool", "update", spec.name, diff, cur.version, {f.name: f.new for f in diff}))
        existing = {r.name: r for r in cur.replicas}
        for r in spec.replicas:
            ref = f"{spec.name}/{r.name}"
            have = existing.get(r.name)
            if have is None:
                changes.append(Change("replica", "create", ref, _created(r.given(exclude=("name",))),
                                      payload={"pool": spec.name, **r.given()}))
            elif diff := _diff(have, r.given(exclude=("name",))):
                changes.append(Change("replica", "update", ref, diff, have.version,
                                      {"pool": spec.name, "name": r.name, "changes": {f.name: f.new for f in diff}}))
        if prune:
            listed = {r.name for r in spec.replicas}
            for name, have in existing.items():
                if name not in listed:
                    changes.append(Change("replica", "delete", f"{spec.name}/{name}",
                                          (FieldChange("endpoint", have.endpoint, None),),
                                          payload={"pool": spec.name, "name": name}))

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
        changes += [Change("tenant", "delete", slug, (FieldChange("pool", pool_names.get(t.pool_id), None),))
                    for slug, t in tenants.items() if slug not in listed]
    if prune_pools:
        listed = {p.name for p in doc.pools or []}
        changes += [Change("pool", "delete", name, (FieldChange("replicas", [r.name for r in p.replicas], None),))
                    for name, p in pools.items() if name not in listed]
    if prune_classes:
        listed = {c.name for c in doc.retention_classes or []}
        changes += [Change("retention_class", "delete", name) for name in classes if name not in listed]

    rank = {key: i for i, key in enumerate(ORDER)}
    return Plan(tuple(sorted(changes, key=lambda c: rank[(c.kind, c.action)])))
