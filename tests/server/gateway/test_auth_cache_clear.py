"""An admin write to a tenant clears this gateway's cached answers for it, however the path names it.

The auth cache's TTL is set long here, so a key still served after its revocation (or a
suspended tenant's) can only come from the cache, never from a race with its expiry.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from server.serving import build_serving_app
from tests.server.admin.conftest import AUTH, make_settings, seed
from tests.tenants.fixtures import Database, _postgres_db, _sqlite_db, db  # noqa: F401


@pytest.mark.parametrize("form", ["slug", "id", "zero-padded id"])
def test_a_revoked_key_and_a_suspended_tenant_are_refused_at_once(db: Database, form: str) -> None:  # noqa: F811
    app = build_serving_app(make_settings(db), session_factory=db.factory, registry=CollectorRegistry(),
                            auth_ttl=3600.0)
    with TestClient(app) as c:
        tenant = seed(c)
        ref = {"slug": tenant["slug"], "id": str(tenant["id"]), "zero-padded id": f"00{tenant['id']}"}[form]
        keys = [c.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": f"k{i}"}).json() for i in (1, 2)]
        users = [{"Authorization": f"Bearer {key['key']}"} for key in keys]
        for user in users:
            assert c.get("/v1/models", headers=user).status_code == 200  # both cached now
        assert c.post(f"/admin/v1/tenants/{ref}/keys/{keys[0]['id']}/revoke", headers=AUTH).status_code == 200
        assert c.get("/v1/models", headers=users[0]).status_code == 401
        assert c.get("/v1/models", headers=users[1]).status_code == 200
        assert c.post(f"/admin/v1/tenants/{ref}/suspend", headers=AUTH).status_code == 200
        assert c.get("/v1/models", headers=users[1]).status_code == 403
