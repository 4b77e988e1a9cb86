"""Admin API: a pool's SLO budget (PUT/GET/DELETE /pools/{ref}/slo) over a real registry; the
guard-state routes need a gateway in the process (their behaviour is tested end to end in
tests/server/gateway/test_slo_guard_e2e.py)."""

from __future__ import annotations

from tests.server.admin.conftest import AUTH, seed


def test_budget_crud_and_audit(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    r = client.get("/admin/v1/pools/gpu-a/slo", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "slo_budget_not_found"
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH,
                   json={"ttft_p99_ms": 800, "window_seconds": 30, "min_requests": 10, "pilot_fraction": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["ttft_p99_ms"], body["itl_p99_ms"], body["cooldown_seconds"], body["hysteresis"], body["enabled"],
            body["pilot_fraction"], body["version"]) == (800, None, 300, 0.2, True, 0.5, 1)
    assert client.get("/admin/v1/pools/gpu-a/slo", headers=AUTH).json() == body
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH, json={"itl_p99_ms": 50, "version": 7})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_version"
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH, json={"itl_p99_ms": 50, "enabled": False, "version": 1})
    assert r.status_code == 200 and r.json()["ttft_p99_ms"] is None and r.json()["enabled"] is False
    events = client.get("/admin/v1/audit", headers=AUTH, params={"entity_type": "pool_slo"}).json()["items"]
    assert [e["action"] for e in events] == ["pool_slo.update", "pool_slo.create"]
    assert client.delete("/admin/v1/pools/gpu-a/slo", headers=AUTH).status_code == 204
    assert client.get("/admin/v1/pools/gpu-a/slo", headers=AUTH).status_code == 404


def test_bad_budgets_are_4xx_naming_the_field(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    for body, field in (({"ttft_p99_ms": 0}, "ttft_p99_ms"), ({"hysteresis": 1.0}, "hysteresis"),
                        ({"enabled": 1}, "enabled"), ({"window_seconds": "5"}, "window_seconds"),
                        ({"pilot_fraction": True}, "pilot_fraction"), ({"nope": 1}, "nope")):
        r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH, json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["field"] == field, r.json()
    assert client.put("/admin/v1/pools/nope/slo", headers=AUTH, json={}).status_code == 404
    assert client.put("/admin/v1/pools/gpu-a/slo", json={}).status_code == 401


def test_guard_state_needs_a_gateway(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    r = client.get("/admin/v1/pools/gpu-a/slo/state", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_gateway"
    assert client.post("/admin/v1/pools/gpu-a/slo/restore", headers=AUTH).status_code == 404


def test_min_requests_is_bounded_by_the_samples_the_guard_keeps(client) -> None:  # type: ignore[no-untyped-def]
    from retention.rollout.guard import DEFAULT_MAX_OBSERVATIONS

    seed(client)
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH,
                   json={"ttft_p99_ms": 500, "min_requests": DEFAULT_MAX_OBSERVATIONS + 1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "min_requests", r.text
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH,
                   json={"ttft_p99_ms": 500, "min_requests": DEFAULT_MAX_OBSERVATIONS})
    assert r.status_code == 200, r.text


def test_guard_state_follows_the_pool_through_a_rename(client, db) -> None:  # type: ignore[no-untyped-def]
    """The guard is the pool's (by id): renamed in the registry, the pool's state answers under
    its new name at once, even before this gateway's next registry poll."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from server.gateway.observe.slo_guard import SloGuards
    from tenants import list_pool_snapshots

    seed(client)
    r = client.put("/admin/v1/pools/gpu-a/slo", headers=AUTH,
                   json={"ttft_p99_ms": 500, "window_seconds": 2, "min_requests": 1, "cooldown_seconds": 600})
    assert r.status_code == 200, r.text
    with db.factory() as session:
        snapshots = list_pool_snapshots(session)
    clock = [1000.0]
    guards = SloGuards(session_factory=db.factory, pools=lambda: snapshots, registry=CollectorRegistry(),
                       clock=lambda: clock[0])
    client.app.state.admin_app.state.slo_guard = guards
    for _ in range(4):
        clock[0] += 1
        guards.observe("gpu-a", "host", ttft=2.0, inter_token=None, kv=None)
        asyncio.run(guards.tick())
    assert guards.tripped() == {"gpu-a": True}
    version = client.get("/admin/v1/pools/gpu-a", headers=AUTH).json()["version"]
    r = client.patch("/admin/v1/pools/gpu-a", headers=AUTH, json={"name": "gpu-b", "version": version})
    assert r.status_code == 200, r.text
    state = client.get("/admin/v1/pools/gpu-b/slo/state", headers=AUTH).json()
    assert (state["pool"], state["configured"], state["tripped"], state["trips"]) == ("gpu-b", True, True, 1), state
    state = client.post("/admin/v1/pools/gpu-b/slo/restore", headers=AUTH).json()
    assert (state["pool"], state["tripped"], state["restores"]) == ("gpu-b", False, 1), state
