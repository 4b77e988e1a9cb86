"""Admin API answers at the registry's edges, the same on SQLite and PostgreSQL: times UTC cannot
hold and filters with NUL are 422 naming the parameter (never a 500), a PATCH carrying only its
version changes nothing, a pool's replicas are capped."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tenants import replicas
from tests.server.admin.conftest import AUTH, seed

A = "/admin/v1"
LATE = "9999-12-31T23:59:59-05:00"  # after UTC's last year once converted
EARLY = "0001-01-01T00:00:00+05:00"  # before UTC's first year once converted


def _error(r, field: str) -> None:  # type: ignore[no-untyped-def]
    assert r.status_code == 422, r.text
    body = r.json()["error"]
    assert (body["code"], body["field"]) == ("invalid_value", field), body


@pytest.mark.parametrize("moment", [LATE, EARLY], ids=["late", "early"])
@pytest.mark.parametrize(("path", "param"), [
    ("/audit", "since"), ("/audit", "until"), ("/tenants/acme/usage", "from"), ("/tenants/acme/usage", "to"),
])
def test_a_time_utc_cannot_hold_is_422_naming_it(client: TestClient, path: str, param: str, moment: str) -> None:
    seed(client)
    _error(client.get(f"{A}{path}", headers=AUTH, params={param: moment}), param)


@pytest.mark.parametrize("param", ["entity_type", "entity_id", "action", "actor"])
def test_an_audit_filter_with_nul_is_422_naming_it_on_every_backend(client: TestClient, param: str) -> None:
    seed(client)
    _error(client.get(f"{A}/audit", headers=AUTH, params={param: "tenant\x00"}), param)
    r = client.get(f"{A}/audit", headers=AUTH, params={param: "nothing-like-it"})
    assert r.status_code == 200 and r.json()["total"] == 0


def test_a_patch_with_only_its_version_changes_nothing(client: TestClient) -> None:
    seed(client)
    events = client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"]
    r = client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["slug"], r.json()["version"]) == ("acme", 1)
    assert client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"] == events  # no empty event
    r = client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1, "rpm_limit": 7})
    assert r.status_code == 200 and r.json()["version"] == 2  # a real change still is one
    r = client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_version"


def test_adding_a_replica_past_the_cap_is_409(client: TestClient) -> None:
    cap = replicas.MAX_REPLICAS
    r = client.post(f"{A}/pools", headers=AUTH, json={
        "name": "wide", "model_name": "m", "primary_blocks": 8,
        "replicas": [{"name": f"r{i}", "endpoint": f"10.0.{i // 250}.{i % 250 + 1}:8001"} for i in range(cap)]})
    assert r.status_code == 201, r.text
    r = client.post(f"{A}/pools/wide/replicas", headers=AUTH, json={"name": "more", "endpoint": "10.9.9.9:8001"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_replicas", r.text
    assert len(client.get(f"{A}/pools/wide/replicas", headers=AUTH).json()) == cap
