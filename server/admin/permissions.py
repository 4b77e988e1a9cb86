"""Who may do what on the admin API: every route's rule, in one table, and the one check.

Roles (``tenants.models.ADMIN_ROLES``):

* ``platform-admin`` — everything;
* ``operator`` — pools, replicas, SLO budgets, captures; reads tenants and classes; no API
  keys, no tenant or credential changes;
* ``tenant-admin`` — scoped to tenants: their API keys, their limits within the caps
  (``tenants.tenant.check_within_caps``), their usage and retention view; nothing else;
* ``viewer`` — reads; a scoped viewer reads only its tenants.

A route's rule names the roles allowed and its *scope mode*:

* ``GLOBAL`` — not about one tenant: a scoped caller (tenant-admin, scoped viewer) gets 403;
* ``TENANT`` — the path's ``{ref}`` names a tenant: a scoped caller whose scope lacks it gets
  the 404 a missing tenant gets (same query, same body: ``tenants.common.get_by_ref(within=)``);
* ``FILTERED`` — a list the route narrows to the caller's scope (``total`` counts only those);
* ``SELF`` — about the caller itself (``whoami``).

Invariants: a route without a rule is refused (403 ``no_rule``), and the route-table test
(tests/server/admin/test_role_matrix.py) fails on it; the table in docs/architecture.md
("Admin roles") is this table, checked by the same test. The audit log is no side door: an
event is read only by a caller who may read the entity it describes (``AUDIT_READ_RULES``,
``hidden_audit_entities``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from server.errors import ApiError
from tenants.admin_credentials import AdminIdentity
from tenants.tenant import get_tenant

GLOBAL, TENANT, FILTERED, SELF = "global", "tenant", "filtered", "self"
ALL = frozenset({"platform-admin", "operator", "tenant-admin", "viewer"})
PLATFORM = frozenset({"platform-admin"})
OPERATE = frozenset({"platform-admin", "operator"})
KEY_READERS = frozenset({"platform-admin", "tenant-admin", "viewer"})
KEY_WRITERS = frozenset({"platform-admin", "tenant-admin"})


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[str]
    scope: str


READ = Rule(ALL, GLOBAL)
OPS = Rule(OPERATE, GLOBAL)
PLATFORM_ONLY = Rule(PLATFORM, GLOBAL)
TENANT_READ = Rule(ALL, TENANT)

# (method, path inside /admin/v1) -> rule. Keep in step with docs/architecture.md "Admin roles".
RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/whoami"): Rule(ALL, SELF),
    # credentials: platform admins only (a tenant-admin or operator mints none)
    ("POST", "/credentials"): PLATFORM_ONLY,
    ("GET", "/credentials"): PLATFORM_ONLY,
    ("GET", "/credentials/{credential_id}"): PLATFORM_ONLY,
    ("DELETE", "/credentials/{credential_id}"): PLATFORM_ONLY,
    ("POST", "/credentials/{credential_id}/rotate"): PLATFORM_ONLY,
    # pools, replicas, SLO budgets and guard, captures
    ("POST", "/pools"): OPS,
    ("GET", "/pools"): READ,
    ("GET", "/pools/{ref}"): READ,
    ("PATCH", "/pools/{ref}"): OPS,
    ("DELETE", "/pools/{ref}"): OPS,
    ("GET", "/pools/{ref}/replicas"): READ,
    ("POST", "/pools/{ref}/replicas"): OPS,
    ("GET", "/pools/{ref}/replicas/{name}"): READ,
    ("PATCH", "/pools/{ref}/replicas/{name}"): OPS,
    ("DELETE", "/pools/{ref}/replicas/{name}"): OPS,
    ("POST", "/pools/{ref}/replicas/{name}/drain"): OPS,
    ("POST", "/pools/{ref}/replicas/{name}/disable"): OPS,
    ("POST", "/pools/{ref}/replicas/{name}/activate"): OPS,
    ("GET", "/pools/{ref}/slo"): READ,
    ("PUT", "/pools/{ref}/slo"): OPS,
    ("DELETE", "/pools/{ref}/slo"): OPS,
    ("GET", "/pools/{ref}/slo/state"): READ,
    ("POST", "/pools/{ref}/slo/restore"): OPS,
    ("POST", "/pools/{ref}/captures"): OPS,
    ("GET", "/pools/{ref}/captures"): READ,
    ("GET", "/pools/{ref}/captures/{capture_id}"): READ,
    ("POST", "/pools/{ref}/captures/{capture_id}/stop"): OPS,
    ("GET", "/pools/{ref}/kv"): READ,  # a pool's tiers and counters span every tenant: unscoped callers only
    # retention classes
    ("POST", "/retention-classes"): PLATFORM_ONLY,
    ("GET", "/retention-classes"): READ,
    ("GET", "/retention-classes/{ref}"): READ,
    ("PATCH", "/retention-classes/{ref}"): PLATFORM_ONLY,
    ("DELETE", "/retention-classes/{ref}"): PLATFORM_ONLY,
    # tenants
    ("POST", "/tenants"): PLATFORM_ONLY,
    ("GET", "/tenants"): Rule(ALL, FILTERED),
    ("GET", "/tenants/{ref}"): TENANT_READ,
    ("PATCH", "/tenants/{ref}"): Rule(KEY_WRITERS, TENANT),  # a tenant-admin: capped limits only
    ("DELETE", "/tenants/{ref}"): Rule(PLATFORM, TENANT),
    ("POST", "/tenants/{ref}/suspend"): Rule(PLATFORM, TENANT),
    ("POST", "/tenants/{ref}/resume"): Rule(PLATFORM, TENANT),
    ("GET", "/tenants/{ref}/retention"): TENANT_READ,
    ("GET", "/tenants/{ref}/usage"): TENANT_READ,
    ("GET", "/tenants/{ref}/captures"): TENANT_READ,
    ("GET", "/tenants/{ref}/kv"): TENANT_READ,
    # a tenant's API keys
    ("POST", "/tenants/{ref}/keys"): Rule(KEY_WRITERS, TENANT),
    ("GET", "/tenants/{ref}/keys"): Rule(KEY_READERS, TENANT),
    ("POST", "/tenants/{ref}/keys/{key_id}/revoke"): Rule(KEY_WRITERS, TENANT),
    # the audit log names every tenant: unscoped callers only, and only events of the entities
    # their role may read (AUDIT_READ_RULES)
    ("GET", "/audit"): READ,
}


# entity type -> the route that reads such entities: ``GET /audit`` shows an event of that type
# only to a role that route allows (credential inventory to platform admins, a tenant's API
# keys to its key readers). Types not listed are readable by every role ``GET /audit`` allows.
AUDIT_READ_RULES: dict[str, tuple[str, str]] = {
    "admin_credential": ("GET", "/credentials"),
    "api_key": ("GET", "/tenants/{ref}/keys"),
}


def hidden_audit_entities(identity: AdminIdentity) -> frozenset[str]:
    """Entity types whose audit events ``identity`` may not read, for ``audit.list_events``.

    By role alone: ``GET /audit`` is ``GLOBAL``, so only unscoped callers reach it, and an
    unscoped caller whose role may read one tenant's keys may read every tenant's."""
    assert RULES[("GET", "/audit")].scope == GLOBAL, "scoped audit readers need a per-tenant filter"
    return frozenset(entity for entity, route in AUDIT_READ_RULES.items() if identity.role not in RULES[route].roles)


def authorize(identity: AdminIdentity, *, method: str, path: str, path_params: dict[str, str],
              session: Session) -> None:
    """Raise 403 (role or scope not allowed) or 404 (a tenant outside a scoped caller's scope,
    exactly as for a missing tenant); return when the call may proceed."""
    rule = RULES.get((method, path))
    if rule is None:
        raise ApiError(403, "no_rule", f"{method} {path} has no permission rule; refused")
    if identity.role not in rule.roles:
        raise ApiError(403, "forbidden", f"the {identity.role} role may not {method} {path}")
    scoped = identity.tenant_ids is not None
    if scoped and rule.scope == GLOBAL:
        raise ApiError(403, "forbidden", f"a tenant-scoped credential may not {method} {path}")
    if scoped and rule.scope == TENANT:
        get_tenant(session, ref=path_params.get("ref", ""), within=identity.tenant_ids)


MATRIX_ROLES = ("platform-admin", "operator", "tenant-admin", "viewer")


def matrix_cell(rule: Rule, role: str) -> str:
    """The docs' cell for ``role`` under ``rule``: ``yes``; ``403``; ``own`` (the caller's tenants:
    another tenant answers 404 exactly as a missing one, lists hold only its tenants; an
    unscoped viewer owns them all); ``unscoped`` (an unscoped viewer yes, a scoped one 403)."""
    if role not in rule.roles:
        return "403"
    if role in ("platform-admin", "operator") or rule.scope == SELF:
        return "yes"
    if rule.scope == GLOBAL:
        return "403" if role == "tenant-admin" else "unscoped"
    return "own"


def matrix_rows() -> list[str]:
    """The markdown rows of docs/architecture.md's role matrix, in ``RULES`` order."""
    rows = ["| route | " + " | ".join(MATRIX_ROLES) + " |", "|---|" + "---|" * len(MATRIX_ROLES)]
    for (method, path), rule in RULES.items():
        rows.append(f"| `{method} {path}` | " + " | ".join(matrix_cell(rule, r) for r in MATRIX_ROLES) + " |")
    return rows
