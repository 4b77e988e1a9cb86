"""Live trace captures through the admin REST API (real HTTP, real registry on both backends)."""

from __future__ import annotations

from sqlalchemy import select

from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_admin_crud import _error

A = "/admin/v1"


def test_capture_lifecycle_audit_and_secrecy(client, db) -> None:  # type: ignore[no-untyped-def]
    from tenants.captures import active_captures
    from tenants.models import TraceCapture

    seed(client)
    r = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"sample_rate": 0.25, "max_bytes": 1_000_000,
                                                                   "tenant": "acme"})
    assert r.status_code == 201, r.text
    cap = r.json()
    assert (cap["pool"], cap["tenant"], cap["sample_rate"], cap["max_bytes"], cap["state"], cap["stopped_at"]) == (
        "gpu-a", "acme", 0.25, 1_000_000, "active", None)
    assert "key" not in cap
    # one active capture per pool
    _error(client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={}), 409, "capture_active", "pool")
    assert client.get(f"{A}/pools/gpu-a/captures/{cap['id']}", headers=AUTH).json() == cap
    assert [c["id"] for c in client.get(f"{A}/pools/gpu-a/captures", headers=AUTH).json()] == [cap["id"]]

    with db.factory() as s:
        (active,) = active_captures(s)
        row = s.scalars(select(TraceCapture)).one()
        assert active.pool == "gpu-a" and active.key == bytes.fromhex(row.key) and len(active.key) == 32

    stopped = client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH)
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped" and stopped.json()["stopped_at"]
    assert client.post(f"{A}/pools/gpu-a/captures/{cap['id']}/stop", headers=AUTH).json()["version"] == \
        stopped.json()["version"]  # a no-op: no second event
    with db.factory() as s:
        assert active_captures(s) == []
    # a new one may start once the old one stopped (default rate and size)
    again = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={})
    assert again.status_code == 201 and (again.json()["sample_rate"], again.json()["tenant"]) == (1.0, None)

    events = client.get(f"{A}/audit?entity_type=trace_capture", headers=AUTH).json()["items"]
    assert [e["action"] for e in events] == ["trace_capture.create", "trace_capture.stop", "trace_capture.create"]
    assert all("key" not in (e["before"] or {}) and "key" not in (e["after"] or {}) for e in events)


def test_capture_errors(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    client.post(f"{A}/pools", headers=AUTH, json={"name": "gpu-b", "model_name": "m", "triton_url": "h:1",
                                                  "primary_blocks": 8})
    _error(client.post(f"{A}/pools/nope/captures", headers=AUTH, json={}), 404, "pool_not_found")
    for body, field in (({"sample_rate": 0}, "sample_rate"), ({"sample_rate": 1.5}, "sample_rate"),
                        ({"max_bytes": 0}, "max_bytes"), ({"max_bytes": "1"}, "max_bytes"), ({"key": "x"}, "key")):
        r = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json=body)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, (body, r.text)
    _error(client.post(f"{A}/pools/gpu-b/captures", headers=AUTH, json={"tenant": "acme"}), 422,
           "tenant_not_on_pool", "tenant")
    _error(client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": "ghost"}), 422,
           "unknown_tenant", "tenant")
    _error(client.get(f"{A}/pools/gpu-a/captures/99", headers=AUTH), 404, "capture_not_found")
    _error(client.post(f"{A}/pools/gpu-a/captures/x/stop", headers=AUTH), 404, "capture_not_found")
    assert client.post(f"{A}/pools/gpu-a/captures", json={}).status_code == 401
    # a pool's captures go with the pool
    assert client.post(f"{A}/pools/gpu-b/captures", headers=AUTH, json={}).status_code == 201
    assert client.delete(f"{A}/pools/gpu-b", headers=AUTH).status_code == 204
