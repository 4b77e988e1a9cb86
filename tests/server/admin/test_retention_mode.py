"""Retention classes carry a mode: static segment priorities, or adaptive (measured reuse)."""

from __future__ import annotations

from tests.server.admin.conftest import AUTH

A = "/admin/v1"


def test_mode_defaults_to_static_and_can_be_adaptive(client) -> None:  # type: ignore[no-untyped-def]
    static = client.post(f"{A}/retention-classes", json={"name": "plain"}, headers=AUTH)
    assert static.status_code == 201, static.text
    assert static.json()["mode"] == "static"
    adaptive = client.post(f"{A}/retention-classes", json={"name": "learned", "mode": "adaptive"}, headers=AUTH)
    assert adaptive.status_code == 201 and adaptive.json()["mode"] == "adaptive"
    body = static.json()
    changed = client.patch(f"{A}/retention-classes/plain", json={"version": body["version"], "mode": "adaptive"}, headers=AUTH)
    assert changed.status_code == 200 and changed.json()["mode"] == "adaptive"


def test_unknown_mode_is_422_naming_the_field(client) -> None:  # type: ignore[no-untyped-def]
    response = client.post(f"{A}/retention-classes", json={"name": "odd", "mode": "clever"}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "mode"
