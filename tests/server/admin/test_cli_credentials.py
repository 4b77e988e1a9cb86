"""`kvgate admin credentials` over a real SQLite file: the secret it prints authenticates on
the admin API over the same registry, and revoke/rotate hold at once."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.server.admin.test_cli import run  # noqa: F401 - the fixture


def test_credentials_commands(run, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=127.0.0.1:8001",
        "--set", "primary_blocks=64")
    run("admin", "classes", "create", "gold")
    run("admin", "tenants", "create", "acme", "--pool", "gpu-a", "--class", "gold")
    run("admin", "tenants", "create", "globex", "--pool", "gpu-a", "--class", "gold")
    created = json.loads(run("admin", "credentials", "create", "acme-ops", "--role", "tenant-admin",
                             "--tenant", "acme").output)
    assert created["tenants"] == ["acme"] and created["secret"].startswith(f"kva_{created['prefix']}_")
    refused = run("admin", "credentials", "create", "x", "--role", "tenant-admin", code=2)  # invalid input
    assert '"field": "tenants"' in refused.output
    listed = json.loads(run("admin", "credentials", "list").output)
    assert listed["total"] == 1 and "secret" not in listed["items"][0]

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cli.db'}", admin_tokens=["ops:" + "t" * 32],
                        key_pepper="cli-test-pepper-0123456789abcdef")
    with TestClient(create_app(settings)) as api:
        me = {"Authorization": f"Bearer {created['secret']}"}
        assert api.get("/admin/v1/whoami", headers=me).json()["tenants"] == ["acme"]
        rotated = json.loads(run("admin", "credentials", "rotate", str(created["id"])).output)
        assert api.get("/admin/v1/whoami", headers=me).status_code == 401
        me = {"Authorization": f"Bearer {rotated['secret']}"}
        assert api.get("/admin/v1/whoami", headers=me).status_code == 200
        shown = json.loads(run("admin", "credentials", "show", str(created["id"])).output)
        assert shown["last_used_at"] is not None
        run("admin", "credentials", "revoke", str(created["id"]))
        assert api.get("/admin/v1/whoami", headers=me).status_code == 401
    actions = [e["action"] for e in json.loads(run("admin", "audit").output)["items"]
               if e["entity_type"] == "admin_credential"]
    assert actions == ["admin_credential.revoke", "admin_credential.rotate", "admin_credential.create"]
