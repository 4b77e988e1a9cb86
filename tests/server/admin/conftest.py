"""Admin API fixtures: a real app over a real registry (SQLite, and PostgreSQL when reachable)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.tenants.fixtures import Database, _postgres_db, _sqlite_db, db, session  # noqa: F401

ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
OTHER_TOKEN = "other-admin-token-fedcba9876543210"
PEPPER = "test-pepper-0123456789abcdef0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def make_settings(db: Database, **overrides: object) -> Settings:
    values: dict[str, object] = dict(
        database_url=db.url, admin_tokens=[f"ops:{ADMIN_TOKEN}", OTHER_TOKEN], key_pepper=PEPPER
    )
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def settings(db: Database) -> Settings:
    return make_settings(db)


@pytest.fixture
def client(db: Database, settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, session_factory=db.factory)
    with TestClient(app) as c:
        yield c


def seed(client: TestClient) -> dict:
    """Pool gpu-a (threshold 35, host tier), class gold, tenant acme; returns the tenant."""
    r = client.post(
        "/admin/v1/pools",
        headers=AUTH,
        json={
            "name": "gpu-a",
            "model_name": "smollm2-135m",
            "triton_url": "127.0.0.1:8001",
            "primary_blocks": 128,
            "secondary_blocks": 256,
            "secondary_offload_min_priority": 35,
        },
    )
    assert r.status_code == 201, r.text
    r = client.post("/admin/v1/retention-classes", headers=AUTH, json={"name": "gold"})
    assert r.status_code == 201, r.text
    r = client.post(
        "/admin/v1/tenants",
        headers=AUTH,
        json={"slug": "acme", "display_name": "Acme", "pool": "gpu-a", "retention_class": "gold"},
    )
    assert r.status_code == 201, r.text
    return r.json()
