"""Deleting a tenant over real HTTP: what goes with it is audited in the delete's transaction,
and a delete that would leave an admin credential scoped to no tenant is refused."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.server.admin.conftest import AUTH, seed
from tests.server.admin.test_credentials import add_tenant, bearer, credential

A = "/admin/v1"


def _events_since(client: TestClient, total_before: int) -> list[dict]:
    page = client.get(f"{A}/audit?limit=500", headers=AUTH).json()
    return page["items"][: page["total"] - total_before]


def _total(client: TestClient) -> int:
    return client.get(f"{A}/audit?limit=1", headers=AUTH).json()["total"]


def test_delete_audits_its_keys_captures_and_credential_scopes(client: TestClient) -> None:
    seed(client)
    globex = add_tenant(client, "globex")
    keys = [client.post(f"{A}/tenants/globex/keys", headers=AUTH, json={"name": n}).json() for n in ("a", "b")]
    assert client.post(f"{A}/tenants/globex/keys/{keys[0]['id']}/revoke", headers=AUTH).status_code == 200
    stopped = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": "globex"}).json()
    assert client.post(f"{A}/pools/gpu-a/captures/{stopped['id']}/stop", headers=AUTH).status_code == 200
    active = client.post(f"{A}/pools/gpu-a/captures", headers=AUTH, json={"tenant": "globex"}).json()
    both = credential(client, "both-ops", "tenant-admin", ["acme", "globex"])
    revoked = credential(client, "old-globex", "tenant-admin", ["globex"])
    assert client.delete(f"{A}/credentials/{revoked['id']}", headers=AUTH).status_code == 204
    before = _total(client)

    assert client.delete(f"{A}/tenants/globex", headers=AUTH).status_code == 204
    events = _events_since(client, before)
    assert [(e["action"], e["entity_id"]) for e in reversed(events)] == [
        ("admin_credential.update", str(both["id"])),
        ("admin_credential.update", str(revoked["id"])),
        ("api_key.delete", str(keys[0]["id"])),
        ("api_key.delete", str(keys[1]["id"])),
        ("trace_capture.delete", str(stopped["id"])),
        ("trace_capture.delete", str(active["id"])),
        ("tenant.delete", str(globex["id"])),
    ]
    assert {e["actor"] for e in events} == {"admin:ops"}
    by_id = {(e["entity_type"], e["entity_id"]): e for e in events}
    scope = by_id[("admin_credential", str(both["id"]))]
    assert (scope["before"]["tenants"], scope["after"]["tenants"]) == (["acme", "globex"], ["acme"])
    assert by_id[("api_key", str(keys[1]["id"]))]["before"]["prefix"] == keys[1]["prefix"]
    assert by_id[("api_key", str(keys[1]["id"]))]["after"] is None
    assert by_id[("trace_capture", str(active["id"]))]["before"]["state"] == "active"
    assert "key" not in by_id[("trace_capture", str(active["id"]))]["before"]
    # what the events say is what happened
    assert client.get(f"{A}/credentials/{both['id']}", headers=AUTH).json()["tenants"] == ["acme"]
    assert client.get(f"{A}/pools/gpu-a/captures/{active['id']}", headers=AUTH).status_code == 404
    assert client.get(f"{A}/whoami", headers=bearer(both["secret"])).json()["tenants"] == ["acme"]


def test_delete_is_refused_while_it_is_a_credentials_only_tenant(client: TestClient) -> None:
    seed(client)
    add_tenant(client, "globex")
    key = client.post(f"{A}/tenants/globex/keys", headers=AUTH, json={"name": "k"}).json()
    admin = credential(client, "globex-admin", "tenant-admin", ["globex"])
    reader = credential(client, "globex-reader", "viewer", ["globex"])
    before = _total(client)

    r = client.delete(f"{A}/tenants/globex", headers=AUTH)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "tenant_orphans_credential"
    for cred in (admin, reader):
        assert f"{cred['name']!r} (id {cred['id']}" in error["message"]
    assert "Revoke" in error["message"]
    # nothing changed: no event, the tenant, its key and the credentials' scopes are all there
    assert _total(client) == before
    assert client.get(f"{A}/tenants/globex/keys", headers=AUTH).json()["items"][0]["id"] == key["id"]
    assert client.get(f"{A}/whoami", headers=bearer(admin["secret"])).json()["tenants"] == ["globex"]

    for cred in (admin, reader):  # the operator revokes them first; then the delete goes through
        assert client.delete(f"{A}/credentials/{cred['id']}", headers=AUTH).status_code == 204
    assert client.delete(f"{A}/tenants/globex", headers=AUTH).status_code == 204
    actions = [e["action"] for e in _events_since(client, before)]
    assert actions.count("admin_credential.update") == 2 and actions[0] == "tenant.delete"
    assert client.get(f"{A}/tenants/globex", headers=AUTH).status_code == 404


def test_a_reused_slug_starts_its_kv_figures_from_zero(db, settings) -> None:  # type: ignore[no-untyped-def]
    """The gateway's per-tenant KV totals are kept by tenant id: the deleted tenant's requests are
    not the new tenant's, though both were "acme" (the Prometheus series keep the slug label)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from engines.contract import KvMetrics
    from server.serving import build_serving_app

    registry = CollectorRegistry()
    app = build_serving_app(settings, session_factory=db.factory, registry=registry)
    with TestClient(app) as gateway:
        old = seed(gateway)
        metrics = app.state.gateway.metrics
        for _ in range(3):
            metrics.observe_request(tenant="acme", pool="gpu-a", status="ok", prompt_tokens=100, completion_tokens=5,
                                    ttft=0.1, latency=0.2, kv=KvMetrics(reused_blocks=7, new_blocks=1),
                                    demoted=False, tenant_id=old["id"])
        figures = gateway.get(f"{A}/tenants/acme/kv", headers=AUTH).json()
        assert (figures["requests"], figures["reused_blocks"], figures["new_blocks"]) == (3, 21, 3)

        assert gateway.delete(f"{A}/tenants/acme", headers=AUTH).status_code == 204
        new = add_tenant(gateway, "acme")
        assert new["id"] != old["id"]
        me = bearer(credential(gateway, "new-acme-admin", "tenant-admin", ["acme"])["secret"])
        figures = gateway.get(f"{A}/tenants/acme/kv", headers=me).json()
        assert (figures["requests"], figures["reused_blocks"], figures["new_blocks"], figures["hit_rate"]) == (
            0, 0, 0, None)
        metrics.observe_request(tenant="acme", pool="gpu-a", status="ok", prompt_tokens=10, completion_tokens=1,
                                ttft=0.1, latency=0.2, kv=KvMetrics(reused_blocks=1, new_blocks=3), demoted=False,
                                tenant_id=new["id"])
        figures = gateway.get(f"{A}/tenants/acme/kv", headers=me).json()
        assert (figures["requests"], figures["reused_blocks"], figures["new_blocks"]) == (1, 1, 3)
        assert 'kvgate_kv_blocks_reused_total{pool="gpu-a",tenant="acme"} 22.0' in generate_latest(registry).decode()
