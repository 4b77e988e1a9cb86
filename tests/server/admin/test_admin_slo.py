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
