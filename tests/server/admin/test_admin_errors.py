"""Bad input and a dead database never produce a 500; every error uses the one shape."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from server.app import create_app
from tenants.db import make_engine, make_session_factory
from tests.server.admin.conftest import AUTH, make_settings, seed

A = "/admin/v1"
GARBAGE = [
    None,
    [],
    "x",
    0,
    -1,
    1e308,
    True,
    {"name": {"nested": 1}},
    {"name": "a" * 10_000},
    {"version": "one"},
    {"version": None},
    {"primary_blocks": 2**64},
    {"pool": [1]},
    {"expires_at": "yesterday"},
    {"slug": "\u0000"},
    {"name": "p", "model_name": "m", "triton_url": "h:1", "primary_blocks": 1, "secondary_offload_min_priority": 2**40},
]
ENDPOINTS = [
    ("post", "/pools"),
    ("patch", "/pools/p"),
    ("post", "/retention-classes"),
    ("patch", "/retention-classes/c"),
    ("post", "/tenants"),
    ("patch", "/tenants/acme"),
    ("post", "/tenants/acme/keys"),
    ("post", "/tenants/acme/suspend"),
]


def _shape(r) -> dict:  # type: ignore[no-untyped-def]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}, body
    return body["error"]


def test_garbage_bodies_are_4xx_with_the_error_shape(client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    for method, path in ENDPOINTS:
        for body in GARBAGE:
            r = client.request(method, f"{A}{path}", headers=AUTH, json=body)
            assert r.status_code < 500, (method, path, body, r.text)
            if r.status_code >= 400:
                _shape(r)
        r = client.request(method, f"{A}{path}", headers={**AUTH, "content-type": "application/json"}, content=b"{nope")
        assert r.status_code == 422 and _shape(r)["field"] == "body"


def test_path_garbage(client) -> None:  # type: ignore[no-untyped-def]
    r = client.get(f"{A}/audit?entity_type=%00", headers=AUTH)  # no stored value holds a NUL: 422 on every backend
    assert r.status_code == 422 and (_shape(r)["code"], _shape(r)["field"]) == ("invalid_value", "entity_type")
    for path in (
        "/pools/%00",
        "/retention-classes/%C2%B9",
        "/tenants/%D9%A3",
        "/pools?offset=9223372036854775808",
        "/tenants/acme/keys/abc/revoke",
        "/tenants/%00/keys",
        "/tenants/" + "9" * 40,
        "/tenants/-1/usage",
        "/tenants/x/keys/99999999999999999999/revoke",
    ):
        r = client.request("post" if path.endswith("revoke") else "get", f"{A}{path}", headers=AUTH)
        assert 400 <= r.status_code < 500, (path, r.text)
        _shape(r)


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/none", "sqlite:////nonexistent-dir/kvgate.db"])
def test_unreachable_database_is_503(db, url: str) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(url, connect_args={"connect_timeout": 1}) if url.startswith("postgresql") else make_engine(url)
    app = create_app(make_settings(db, database_url=url), session_factory=make_session_factory(engine))
    try:
        with TestClient(app) as c:
            for method, path, body in (
                ("get", "/pools", None),
                ("post", "/retention-classes", {"name": "c"}),
                ("get", "/tenants/acme", None),
            ):
                r = c.request(method, f"{A}{path}", headers=AUTH, json=body)
                assert r.status_code == 503, r.text
                assert _shape(r)["code"] == "database_unavailable"
                assert r.headers["retry-after"] == "5"
    finally:
        engine.dispose()


def test_unmigrated_database_is_503(db, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An unmigrated (empty) database is a 503, not a 500."""
    if db.backend != "sqlite":
        pytest.skip("one backend is enough for this case")
    engine = create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    app = create_app(make_settings(db), session_factory=make_session_factory(engine))
    with TestClient(app) as c:
        r = c.get(f"{A}/pools", headers=AUTH)
        assert r.status_code == 503 and json.loads(r.text)["error"]["code"] == "database_unavailable"
    engine.dispose()
