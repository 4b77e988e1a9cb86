"""Admin REST API over real HTTP (TestClient) and a real registry: CRUD, pagination, errors."""

from __future__ import annotations

import pytest

from tests.server.admin.conftest import AUTH, seed

A = "/admin/v1"


def _error(r, status: int, code: str | None = None, field: str | None = "<any>"):  # type: ignore[no-untyped-def]
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}
    if code is not None:
        assert body["error"]["code"] == code
    if field != "<any>":
        assert body["error"]["field"] == field
    return body["error"]


def test_openapi_and_docs_are_served(client) -> None:  # type: ignore[no-untyped-def]
    spec = client.get(f"{A}/openapi.json").json()
    assert {"/pools", "/retention-classes", "/tenants", "/tenants/{ref}/keys", "/audit"} <= set(spec["paths"])
    docs = client.get(f"{A}/docs")
    assert docs.status_code == 200 and "/admin/v1/openapi.json" in docs.text


def test_pool_crud_round_trip(client) -> None:  # type: ignore[no-untyped-def]
    r = client.post(
        f"{A}/pools",
        headers=AUTH,
        json={"name": "gpu-a", "model_name": "m", "triton_url": "h:8001", "primary_blocks": 64},
    )
    assert r.status_code == 201
    pool = r.json()
    assert (pool["triton_model"], pool["tokens_per_block"], pool["secondary_blocks"], pool["version"]) == (
        "kvgate_llm",
        32,
        0,
        1,
    )
    assert client.get(f"{A}/pools/gpu-a", headers=AUTH).json() == pool
    assert client.get(f"{A}/pools/{pool['id']}", headers=AUTH).json() == pool
    r = client.patch(
        f"{A}/pools/gpu-a",
        headers=AUTH,
        json={"version": 1, "secondary_blocks": 512, "secondary_offload_min_priority": 60},
    )
    assert r.status_code == 200 and (r.json()["secondary_blocks"], r.json()["version"]) == (512, 2)
    _error(
        client.patch(f"{A}/pools/gpu-a", headers=AUTH, json={"version": 1, "primary_blocks": 9}),
        409,
        "stale_version",
        "version",
    )
    assert client.delete(f"{A}/pools/gpu-a", headers=AUTH).status_code == 204
    _error(client.get(f"{A}/pools/gpu-a", headers=AUTH), 404, "pool_not_found")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"secondary_offload_min_priority": 101}, "secondary_offload_min_priority"),
        ({"secondary_offload_min_priority": -1}, "secondary_offload_min_priority"),
        ({"primary_blocks": 0}, "primary_blocks"),
        ({"primary_blocks": "many"}, "primary_blocks"),
        ({"name": "123"}, "name"),
        ({"name": None}, "name"),
        ({"tokens_per_block": 1.5}, "tokens_per_block"),
        ({"surprise": 1}, "surprise"),
        ({"primary_blocks": True}, "primary_blocks"),  # no bool -> int coercion
        ({"secondary_blocks": "8"}, "secondary_blocks"),  # no str -> int coercion
    ],
)
def test_pool_validation_is_422_naming_the_field(client, body, field) -> None:  # type: ignore[no-untyped-def]
    payload = {"name": "p", "model_name": "m", "triton_url": "h:1", "primary_blocks": 8, **body}
    _error(client.post(f"{A}/pools", headers=AUTH, json=payload), 422, field=field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"system_priority": 101}, "system_priority"),
        ({"turn_duration_ms": -1}, "turn_duration_ms"),
        ({"decode_priority": -3}, "decode_priority"),
        ({"context_priority": None}, "context_priority"),
        ({"system_priority": True}, "system_priority"),
        ({"system_priority": "7"}, "system_priority"),
        ({"turn_priority": 7.5}, "turn_priority"),
        ({"context_duration_ms": 2**31}, "context_duration_ms"),  # INT32 on the engine contract
    ],
)
def test_class_validation(client, body, field) -> None:  # type: ignore[no-untyped-def]
    _error(client.post(f"{A}/retention-classes", headers=AUTH, json={"name": "c", **body}), 422, field=field)


def test_class_update_can_clear_a_duration_but_not_a_priority(client) -> None:  # type: ignore[no-untyped-def]
    cls = client.post(f"{A}/retention-classes", headers=AUTH, json={"name": "c"}).json()
    assert cls["turn_duration_ms"] == 30_000
    r = client.patch(f"{A}/retention-classes/c", headers=AUTH, json={"version": 1, "turn_duration_ms": None})
    assert r.status_code == 200 and r.json()["turn_duration_ms"] is None
    _error(
        client.patch(f"{A}/retention-classes/c", headers=AUTH, json={"version": 2, "turn_priority": None}),
        422,
        field="turn_priority",
    )


def test_tenant_create_conflicts_and_references(client) -> None:  # type: ignore[no-untyped-def]
    t = seed(client)
    assert (t["pool"], t["retention_class"], t["status"], t["isolation"]) == ("gpu-a", "gold", "active", "salted")
    _error(
        client.post(
            f"{A}/tenants",
            headers=AUTH,
            json={"slug": "acme", "display_name": "A", "pool": "gpu-a", "retention_class": "gold"},
        ),
        409,
        "duplicate",
        "slug",
    )
    _error(
        client.post(
            f"{A}/tenants",
            headers=AUTH,
            json={"slug": "b", "display_name": "B", "pool": "nope", "retention_class": "gold"},
        ),
        422,
        "unknown_pool",
        "pool",
    )
    _error(
        client.post(
            f"{A}/tenants", headers=AUTH, json={"slug": "b", "display_name": "B", "pool": 1, "retention_class": 999}
        ),
        422,
        "unknown_retention_class",
        "retention_class",
    )
    _error(
        client.post(
            f"{A}/tenants",
            headers=AUTH,
            json={"slug": "b", "display_name": "B", "pool": "gpu-a", "retention_class": "gold", "kv_quota_fraction": 0},
        ),
        422,
        field="kv_quota_fraction",
    )
    _error(
        client.post(
            f"{A}/tenants",
            headers=AUTH,
            json={
                "slug": "b",
                "display_name": "B",
                "pool": "gpu-a",
                "retention_class": "gold",
                "kv_quota_fraction": 1.5,
            },
        ),
        422,
        field="kv_quota_fraction",
    )
    _error(client.delete(f"{A}/pools/gpu-a", headers=AUTH), 409, "pool_in_use")
    _error(client.delete(f"{A}/retention-classes/gold", headers=AUTH), 409, "retention_class_in_use")


def test_cache_salt_is_never_returned_or_accepted(client) -> None:  # type: ignore[no-untyped-def]
    created = seed(client)
    responses = [
        created,
        client.get(f"{A}/tenants/acme", headers=AUTH).json(),
        client.get(f"{A}/tenants", headers=AUTH).json(),
        client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1, "rpm_limit": 3}).json(),
        client.get(f"{A}/audit", headers=AUTH).json(),
    ]
    for body in responses:
        assert "cache_salt" not in str(body)
    _error(
        client.post(
            f"{A}/tenants",
            headers=AUTH,
            json={"slug": "b", "display_name": "B", "pool": "gpu-a", "retention_class": "gold", "cache_salt": "0" * 32},
        ),
        422,
        field="cache_salt",
    )
    _error(
        client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 2, "cache_salt": "0" * 32}),
        422,
        field="cache_salt",
    )


def test_tenant_update_suspend_resume_and_retention_view(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    client.post(
        f"{A}/retention-classes",
        headers=AUTH,
        json={
            "name": "bronze",
            "system_priority": 34,
            "context_priority": 35,
            "turn_priority": 10,
            "decode_priority": 0,
        },
    )
    r = client.patch(f"{A}/tenants/acme", headers=AUTH, json={"version": 1, "retention_class": "bronze"})
    assert r.status_code == 200 and r.json()["retention_class"] == "bronze"
    view = client.get(f"{A}/tenants/acme/retention", headers=AUTH).json()
    assert view["secondary_offload_min_priority"] == 35
    assert {s["segment"]: s["tier_on_eviction"] for s in view["segments"]} == {
        "system": "dropped",
        "context": "host",
        "turn": "dropped",
        "decode": "dropped",
    }
    assert r.json()["retention_view"] == view["segments"]
    r = client.post(f"{A}/tenants/acme/suspend", headers=AUTH)
    assert r.json()["status"] == "suspended"
    _error(client.post(f"{A}/tenants/acme/resume", headers=AUTH, json={"version": 2}), 409, "stale_version")
    r = client.post(f"{A}/tenants/acme/resume", headers=AUTH, json={"version": 3})
    assert (r.json()["status"], r.json()["version"]) == ("active", 4)
    listed = client.get(f"{A}/tenants?status=active", headers=AUTH).json()
    assert [t["slug"] for t in listed["items"]] == ["acme"]
    _error(client.get(f"{A}/tenants?status=zombie", headers=AUTH), 422, field="status")


def test_pagination_envelope_and_bounds(client) -> None:  # type: ignore[no-untyped-def]
    for i in range(7):
        assert client.post(f"{A}/retention-classes", headers=AUTH, json={"name": f"c{i}"}).status_code == 201
    page = client.get(f"{A}/retention-classes?limit=3&offset=5", headers=AUTH).json()
    assert set(page) == {"items", "total", "limit", "offset"}
    assert ([c["name"] for c in page["items"]], page["total"], page["limit"], page["offset"]) == (["c5", "c6"], 7, 3, 5)
    for query, field in (("limit=0", "limit"), ("limit=501", "limit"), ("offset=-1", "offset"), ("limit=x", "limit")):
        _error(client.get(f"{A}/retention-classes?{query}", headers=AUTH), 422, field=field)
    assert client.get(f"{A}/retention-classes?limit=500", headers=AUTH).status_code == 200


def test_unknown_route_and_method_use_the_error_shape(client) -> None:  # type: ignore[no-untyped-def]
    _error(client.get(f"{A}/nothing", headers=AUTH), 404)
    _error(client.put(f"{A}/pools", headers=AUTH, json={}), 405)


def test_key_expiry_is_an_iso_timestamp_with_offset(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    r = client.post(
        f"{A}/tenants/acme/keys", headers=AUTH, json={"name": "k", "expires_at": "2099-01-01T00:00:00+02:00"}
    )
    assert r.status_code == 201, r.text
    assert r.json()["expires_at"].startswith("2098-12-31T22:00:00")
    _error(
        client.post(f"{A}/tenants/acme/keys", headers=AUTH, json={"expires_at": "2099-01-01T00:00:00"}),
        422,
        field="expires_at",
    )
    _error(
        client.post(f"{A}/tenants/acme/keys", headers=AUTH, json={"expires_at": "2001-01-01T00:00:00Z"}),
        422,
        field="expires_at",
    )
    _error(client.post(f"{A}/tenants/acme/keys", headers=AUTH, json={"name": True}), 422, field="name")
