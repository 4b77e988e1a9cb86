"""A numeric reference too long to be any row's id names no row: the answer a well-formed missing id gets.

Python refuses ``int()`` of a string of more than 4300 digits (ValueError); no id has more
digits than ``tenants.common.MAX_ID``, so such a reference is "no such row" before any
``int()``: a path reference is a 404 ``*_not_found``, a body or query reference the route's
422 naming the field (a scoped caller's ``?pool=`` filter: the empty page any unknown pool
gets), for every role (a scoped caller's check reads the path's tenant too) and in the console.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_console import sign_in
from tests.server.admin.test_credentials import bearer, credential

A = "/admin/v1"
BIG = "1" * 4301  # one digit past Python's int-from-str limit
MISSING = "99999"  # well-formed, names no row


def _answer(r) -> tuple[int, str, str | None]:  # type: ignore[no-untyped-def]
    assert r.status_code < 500, r.text[:300]
    error = r.json()["error"]
    return r.status_code, error["code"], error["field"]


def _same_as_missing(client: TestClient, headers: dict, method: str, path: str, body: dict | None = None) -> tuple:
    """The route's answer for BIG in place of ``{id}``, checked equal to its answer for a missing id."""
    def call(ref: str):  # type: ignore[no-untyped-def]
        filled = path.replace("{id}", ref)
        payload = None if body is None else {k: (ref if v == "{id}" else v) for k, v in body.items()}
        return client.request(method, f"{A}{filled}", headers=headers, json=payload)

    big, missing = _answer(call(BIG)), _answer(call(MISSING))
    assert big == missing, (method, path, body, big, missing)
    assert big[0] in (404, 422), (method, path, big)
    return big


def test_long_path_references_are_not_found(client: TestClient) -> None:
    tenant = seed(client)
    cap = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={}).json()
    for method, path, body, expected in (
        ("GET", "/tenants/{id}", None, (404, "tenant_not_found", None)),
        ("PATCH", "/tenants/{id}", {"version": 1}, (404, "tenant_not_found", None)),
        ("GET", "/tenants/{id}/keys", None, (404, "tenant_not_found", None)),
        ("POST", "/tenants/{id}/suspend", None, (404, "tenant_not_found", None)),
        ("DELETE", "/tenants/{id}", None, (404, "tenant_not_found", None)),
        ("GET", "/pools/{id}", None, (404, "pool_not_found", None)),
        ("DELETE", "/pools/{id}", None, (404, "pool_not_found", None)),
        ("GET", "/pools/{id}/captures", None, (404, "pool_not_found", None)),
        ("GET", "/retention-classes/{id}", None, (404, "retention_class_not_found", None)),
        ("PATCH", "/retention-classes/{id}", {"version": 1}, (404, "retention_class_not_found", None)),
        ("GET", "/pools/gpu-a/captures/{id}", None, (404, "capture_not_found", None)),
        ("POST", "/pools/gpu-a/captures/{id}/stop", None, (404, "capture_not_found", None)),
    ):
        assert _same_as_missing(client, AUTH, method, path, body) == expected
    # the capture and the tenant are untouched, and leading zeros still name a row however many
    assert client.get(f"{A}/pools/gpu-a/captures/{cap['id']}", headers=AUTH).json()["state"] == "active"
    r = client.get(f"{A}/tenants/{'0' * 4400}{tenant['id']}", headers=AUTH)
    assert r.status_code == 200 and r.json()["slug"] == "acme", r.text[:300]
    r = client.get(f"{A}/pools/gpu-a/captures/{'0' * 4400}{cap['id']}", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == cap["id"], r.text[:300]


def test_no_route_fails_on_a_long_path_reference(client: TestClient) -> None:
    """Every path parameter of every admin route, as an unscoped and as a scoped caller."""
    seed(client)
    scoped = bearer(credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"])
    fill = {"ref": None, "name": "r0", "key_id": "1", "capture_id": "1", "credential_id": "1"}
    paths = client.app.state.admin_app.openapi()["paths"]  # type: ignore[attr-defined]
    failures = []
    for path, operations in paths.items():
        params = re.findall(r"{(\w+)}", path)
        for method in operations:
            body = {"version": 1} if method == "patch" else {"overlap_seconds": 0} if path.endswith("rotate") \
                else {} if method in ("post", "put") else None
            for param in params:
                filled = path
                for other in params:
                    value = BIG if other == param else fill[other] or ("gpu-a" if path.startswith("/pools") else "acme")
                    filled = filled.replace(f"{{{other}}}", value)
                for headers in (AUTH, scoped):
                    r = client.request(method, f"{A}{filled}", headers=headers, json=body)
                    if not 400 <= r.status_code < 500:
                        failures.append((method, path, param, r.status_code, r.text[:120]))
    assert failures == []


def test_long_body_and_query_references_name_their_field(client: TestClient) -> None:
    seed(client)
    new = {"slug": "big", "display_name": "Big", "pool": "gpu-a", "retention_class": "gold"}
    for method, path, body, expected in (
        ("POST", "/tenants", {**new, "pool": "{id}"}, (422, "unknown_pool", "pool")),
        ("POST", "/tenants", {**new, "retention_class": "{id}"}, (422, "unknown_retention_class", "retention_class")),
        ("PATCH", "/tenants/acme", {"version": 1, "pool": "{id}"}, (422, "unknown_pool", "pool")),
        ("PATCH", "/tenants/acme", {"version": 1, "retention_class": "{id}"},
         (422, "unknown_retention_class", "retention_class")),
        ("GET", "/tenants?pool={id}", None, (422, "unknown_pool", "pool")),
    ):
        assert _same_as_missing(client, AUTH, method, path, body) == expected
    assert client.get(f"{A}/tenants/big", headers=AUTH).status_code == 404


def test_a_scoped_caller_gets_the_missing_tenant_answer(client: TestClient) -> None:
    seed(client)
    scoped = bearer(credential(client, "acme-ops", "tenant-admin", ["acme"])["secret"])
    viewer = bearer(credential(client, "acme-eyes", "viewer", ["acme"])["secret"])
    for headers in (scoped, viewer):
        for method, path in (("GET", "/tenants/{id}"), ("GET", "/tenants/{id}/keys"), ("GET", "/tenants/{id}/usage")):
            assert _same_as_missing(client, headers, method, path) == (404, "tenant_not_found", None)
        # a pool it cannot see is an empty page for a scoped caller, whatever the reference
        pages = [client.get(f"{A}/tenants?pool={ref}", headers=headers) for ref in (BIG, MISSING)]
        assert [(r.status_code, r.json()["total"]) for r in pages] == [(200, 0), (200, 0)]
    assert _same_as_missing(client, scoped, "POST", "/tenants/{id}/keys", {"name": "k"}) == \
        (404, "tenant_not_found", None)


@pytest.mark.parametrize("role", ["platform-admin", "tenant-admin"])
def test_the_console_answers_a_long_tenant_reference_as_a_missing_one(db, settings, role: str) -> None:
    with TestClient(create_app(settings, session_factory=db.factory), base_url="http://testserver") as c:
        seed(c)
        token = None if role == "platform-admin" else credential(c, "acme-ops", role, ["acme"])["secret"]
        sign_in(c, *([token] if token else []))
        big, missing = c.get(f"/console/tenants/{BIG}"), c.get(f"/console/tenants/{MISSING}")
        assert big.status_code == missing.status_code and 400 <= big.status_code < 500, big.text[:300]

        def main(text: str) -> str:
            block = re.search(r"<main.*?</main>", text, re.S)
            return (block.group(0) if block else text).replace(BIG[:80], MISSING)

        assert main(big.text) == main(missing.text)


def test_the_auth_cache_hook_reads_a_long_tenant_reference() -> None:
    from server.gateway.app import _tenant_of

    assert _tenant_of(f"/admin/v1/tenants/{BIG}/keys") == BIG
    assert _tenant_of(f"/admin/v1/tenants/{'0' * 4400}7/keys") == "7"
    assert _tenant_of("/admin/v1/tenants/007") == "7" and _tenant_of("/admin/v1/tenants/acme") == "acme"
