"""Pool replicas through the admin REST API (real HTTP, real registry on both backends)."""

from __future__ import annotations

from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_admin_crud import _error

A = "/admin/v1"


def test_replica_lifecycle_over_http(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)  # pool gpu-a from the legacy triton_url: one replica r0
    pool = client.get(f"{A}/pools/gpu-a", headers=AUTH).json()
    assert [(r["name"], r["endpoint"], r["state"], r["weight"]) for r in pool["replicas"]] == [
        ("r0", "127.0.0.1:8001", "active", 1)
    ]
    assert pool["triton_url"] == "127.0.0.1:8001"

    r = client.post(f"{A}/pools/gpu-a/replicas", headers=AUTH, json={"name": "r1", "endpoint": "engine-1:8001",
                                                                      "weight": 2})
    assert r.status_code == 201, r.text
    assert (r.json()["name"], r.json()["state"], r.json()["weight"], r.json()["version"]) == ("r1", "active", 2, 1)
    listed = client.get(f"{A}/pools/gpu-a/replicas", headers=AUTH).json()
    assert [x["name"] for x in listed] == ["r0", "r1"]
    assert client.get(f"{A}/pools/gpu-a/replicas/r1", headers=AUTH).json() == r.json()

    r = client.patch(f"{A}/pools/gpu-a/replicas/r1", headers=AUTH, json={"version": 1, "weight": 5})
    assert r.status_code == 200 and (r.json()["weight"], r.json()["version"]) == (5, 2)
    _error(client.patch(f"{A}/pools/gpu-a/replicas/r1", headers=AUTH, json={"version": 1, "weight": 6}),
           409, "stale_version", "version")

    drained = client.post(f"{A}/pools/gpu-a/replicas/r0/drain", headers=AUTH)
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    assert client.get(f"{A}/pools/gpu-a", headers=AUTH).json()["triton_url"] == "engine-1:8001"
    assert client.post(f"{A}/pools/gpu-a/replicas/r0/disable", headers=AUTH, json={"version": 2}).json()["state"] \
        == "disabled"
    _error(client.post(f"{A}/pools/gpu-a/replicas/r0/activate", headers=AUTH, json={"version": 1}),
           409, "stale_version")
    assert client.post(f"{A}/pools/gpu-a/replicas/r0/activate", headers=AUTH).json()["state"] == "active"

    assert client.delete(f"{A}/pools/gpu-a/replicas/r0", headers=AUTH).status_code == 204
    last = _error(client.delete(f"{A}/pools/gpu-a/replicas/r1", headers=AUTH), 409, "last_replica", "name")
    assert "last replica" in last["message"]
    _error(client.get(f"{A}/pools/gpu-a/replicas/r0", headers=AUTH), 404, "replica_not_found")
    _error(client.get(f"{A}/pools/nope/replicas", headers=AUTH), 404, "pool_not_found")

    actions = [e["action"] for e in client.get(f"{A}/audit?entity_type=pool_replica", headers=AUTH).json()["items"]]
    assert actions == [  # newest first
        "pool_replica.delete",
        "pool_replica.activate",
        "pool_replica.disable",
        "pool_replica.drain",
        "pool_replica.update",
        "pool_replica.create",
    ]


def test_pool_create_with_replicas_and_errors(client) -> None:  # type: ignore[no-untyped-def]
    body = {"name": "gpu-b", "model_name": "m", "primary_blocks": 8,
            "replicas": [{"name": "a", "endpoint": "10.0.0.1:8001"}, {"name": "b", "endpoint": "10.0.0.2:8001",
                                                                      "state": "disabled"}]}
    r = client.post(f"{A}/pools", headers=AUTH, json=body)
    assert r.status_code == 201, r.text
    assert [(x["name"], x["state"]) for x in r.json()["replicas"]] == [("a", "active"), ("b", "disabled")]
    assert r.json()["triton_url"] == "10.0.0.1:8001"

    base = {"name": "gpu-c", "model_name": "m", "primary_blocks": 8}
    _error(client.post(f"{A}/pools", headers=AUTH, json=base), 422, "invalid_value", "replicas")
    _error(client.post(f"{A}/pools", headers=AUTH, json={**base, "triton_url": "h:1", "replicas": body["replicas"]}),
           422, None, "replicas")
    _error(client.post(f"{A}/pools", headers=AUTH, json={**base, "triton_url": "no-port"}), 422, None, "triton_url")
    _error(client.post(f"{A}/pools", headers=AUTH, json={**base, "replicas": [{"name": "a", "endpoint": "h:1"},
                                                                              {"name": "a", "endpoint": "h:2"}]}),
           422, None, "replicas.1.name")
    _error(client.post(f"{A}/pools", headers=AUTH, json={**base, "replicas": [{"name": "a", "endpoint": "h:1",
                                                                               "salt": 1}]}),
           422, None, "replicas.0.salt")
    _error(client.post(f"{A}/pools/gpu-b/replicas", headers=AUTH, json={"name": "a", "endpoint": "h:1"}),
           409, "duplicate", "name")
    _error(client.post(f"{A}/pools/gpu-b/replicas", headers=AUTH, json={"name": "c", "endpoint": "h:99999"}),
           422, None, "endpoint")
    _error(client.post(f"{A}/pools/gpu-b/replicas", headers=AUTH, json={"name": "c", "endpoint": "h:1",
                                                                         "weight": 0}), 422, None, "weight")
    _error(client.patch(f"{A}/pools/gpu-b/replicas/a", headers=AUTH, json={"version": 1, "name": "z"}),
           422, None, "name")
    _error(client.patch(f"{A}/pools/gpu-b", headers=AUTH, json={"version": 1, "triton_url": "h:2"}),
           422, None, "triton_url")
    # The pool's own audit event lists the replicas it was created with.
    created = client.get(f"{A}/audit?action=pool.create", headers=AUTH).json()["items"][0]
    assert [x["name"] for x in created["after"]["replicas"]] == ["a", "b"]
    assert client.delete(f"{A}/pools/gpu-b", headers=AUTH).status_code == 204
