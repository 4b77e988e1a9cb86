"""The role x route matrix, generated from the admin app's own route table.

* every operation of the admin app has a rule in ``server.admin.permissions.RULES`` (a new
  route without one fails here, and is refused at run time with 403 ``no_rule``);
* docs/architecture.md's "Admin roles" table is exactly the code's;
* every route is called as every role (platform-admin, operator, tenant-admin scoped to
  acme, viewer, viewer scoped to acme) on a seeded registry, and answers as its rule says:
  403 where the role may not, 404 with the missing-tenant body for another tenant, and
  neither 401 nor 403 where it may.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from fastapi.testclient import TestClient

from server.admin.deps import require_admin
from server.admin.permissions import FILTERED, GLOBAL, RULES, TENANT, matrix_cell, matrix_rows
from server.app import create_app
from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_credentials import add_tenant, bearer, credential

ROOT = Path(__file__).resolve().parents[3]
ROLE_ORDER = ("acme-viewer", "viewer", "tenant-admin", "operator", "platform-admin")  # destructive last


def _operations(client: TestClient) -> set[tuple[str, str]]:
    """(method, path) of every route the admin app serves, from its route table's OpenAPI document."""
    admin_app = client.app.state.admin_app  # type: ignore[attr-defined]
    paths = admin_app.openapi()["paths"]
    return {(method.upper(), path) for path, item in paths.items() for method in item}


def test_every_route_has_a_rule_and_the_docs_table_is_the_codes(client: TestClient) -> None:
    operations = _operations(client)
    assert operations - set(RULES) == set(), "routes without a permission rule"
    assert set(RULES) - operations == set(), "rules for routes that do not exist"
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- role-matrix:start -->\n(.*?)\n<!-- role-matrix:end -->", doc, re.S)
    assert block, "docs/architecture.md lost its role matrix"
    assert block.group(1).splitlines() == matrix_rows()


def test_a_route_without_a_rule_is_refused(db, settings) -> None:  # type: ignore[no-untyped-def]
    app = create_app(settings, session_factory=db.factory)

    def extra(_actor: Annotated[str, Depends(require_admin)]) -> dict:
        return {}

    app.state.admin_app.add_api_route("/extra", extra, methods=["GET"])
    with TestClient(app) as c:
        r = c.get("/admin/v1/extra", headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "no_rule", r.text
        assert c.get("/admin/v1/extra").status_code == 401


def _seed(client: TestClient) -> tuple[dict[str, tuple[str, bool]], dict[str, str]]:
    seed(client)
    add_tenant(client, "globex")
    key = client.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": "k"}).json()
    capture = client.post("/admin/v1/pools/gpu-a/captures", headers=AUTH, json={"tenant": "acme"}).json()
    victim = credential(client, "victim", "viewer")
    who = {
        "platform-admin": (AUTH["Authorization"][7:], False),
        "operator": (credential(client, "ops", "operator")["secret"], False),
        "tenant-admin": (credential(client, "acme-admin", "tenant-admin", ["acme"])["secret"], True),
        "viewer": (credential(client, "viewer", "viewer")["secret"], False),
        "acme-viewer": (credential(client, "acme-viewer", "viewer", ["acme"])["secret"], True),
    }
    params = {"name": "r0", "capture_id": str(capture["id"]), "key_id": str(key["id"]),
              "credential_id": str(victim["id"])}
    return who, params


def _fill(path: str, params: dict[str, str], tenant: str) -> str:
    ref = "gpu-a" if path.startswith("/pools") else "gold" if path.startswith("/retention-classes") else tenant
    out = path.replace("{ref}", ref)
    for name, value in params.items():
        out = out.replace("{" + name + "}", value)
    return "/admin/v1" + out


def test_every_route_as_every_role(client: TestClient) -> None:
    who, params = _seed(client)
    missing_globex = {"error": {"code": "tenant_not_found", "message": "tenant 'globex' does not exist",
                                "field": None}}
    calls = 0
    for identity in ROLE_ORDER:
        secret, scoped = who[identity]
        role = "viewer" if identity == "acme-viewer" else identity
        headers = bearer(secret)
        for (method, path), rule in RULES.items():
            cell = matrix_cell(rule, role)
            allowed = cell in ("yes", "own") or (cell == "unscoped" and not scoped)
            body = {} if method in ("POST", "PUT", "PATCH") else None
            r = client.request(method, _fill(path, params, "acme"), headers=headers, json=body)
            calls += 1
            where = (identity, method, path, r.status_code, r.text[:200])
            if not allowed:
                assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", where
                continue
            assert r.status_code not in (401, 403), where
            if r.status_code == 404:
                assert r.json()["error"]["code"] != "tenant_not_found" or identity == "platform-admin", where
            if scoped and rule.scope == TENANT:
                foreign = client.request(method, _fill(path, params, "globex"), headers=headers, json=body)
                assert foreign.status_code == 404 and foreign.json() == missing_globex, where
            if scoped and rule.scope == FILTERED:
                assert r.json()["total"] == 1 and [t["slug"] for t in r.json()["items"]] == ["acme"], where
            if scoped:
                assert rule.scope != GLOBAL, where
    assert calls == len(RULES) * len(ROLE_ORDER)
