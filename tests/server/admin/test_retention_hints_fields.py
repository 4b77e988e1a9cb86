"""Retention classes carry the client-hint rules: off by default, bounded, editable everywhere."""

from __future__ import annotations

import json

import pytest

from tests.server.admin.conftest import AUTH

A = "/admin/v1"


def test_hints_are_off_by_default_and_a_class_opts_in(client) -> None:  # type: ignore[no-untyped-def]
    plain = client.post(f"{A}/retention-classes", json={"name": "plain"}, headers=AUTH)
    assert plain.status_code == 201, plain.text
    body = plain.json()
    assert (body["hints_enabled"], body["hint_max_ttl_ms"], body["hint_max_priority"], body["hint_quota_fraction"]) == (
        False, 3_600_000, 60, 0.5)
    changed = client.patch(f"{A}/retention-classes/plain", headers=AUTH, json={
        "version": body["version"], "hints_enabled": True, "hint_max_ttl_ms": 300_000, "hint_max_priority": 45,
        "hint_quota_fraction": 0.25})
    assert changed.status_code == 200, changed.text
    got = changed.json()
    assert (got["hints_enabled"], got["hint_max_ttl_ms"], got["hint_max_priority"], got["hint_quota_fraction"]) == (
        True, 300_000, 45, 0.25)


@pytest.mark.parametrize("field,value", [
    ("hints_enabled", 1), ("hints_enabled", "yes"), ("hint_max_ttl_ms", 0), ("hint_max_ttl_ms", True),
    ("hint_max_priority", 101), ("hint_quota_fraction", 0), ("hint_quota_fraction", 1.5),
])
def test_bad_hint_fields_are_422_naming_the_field(client, field, value) -> None:  # type: ignore[no-untyped-def]
    response = client.post(f"{A}/retention-classes", json={"name": "odd", field: value}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_service_validation_refuses_what_the_schema_would(session) -> None:  # type: ignore[no-untyped-def]
    from tenants import retention_classes
    from tenants.errors import InvalidField
    from tests.tenants.factories import now

    with pytest.raises(InvalidField) as err:
        retention_classes.create_class(session, actor="t", now=now(), name="x", hint_max_ttl_ms=None)
    assert err.value.field == "hint_max_ttl_ms"
    with pytest.raises(InvalidField) as err:
        retention_classes.create_class(session, actor="t", now=now(), name="x", hints_enabled=1)
    assert err.value.field == "hints_enabled"


def test_the_conversation_hold_has_its_own_switch_off_by_default(client) -> None:  # type: ignore[no-untyped-def]
    hinted = client.post(f"{A}/retention-classes", json={"name": "hinted", "hints_enabled": True}, headers=AUTH)
    assert hinted.status_code == 201, hinted.text
    assert hinted.json()["conversation_hold_enabled"] is False  # hints on do not turn the hold on
    held = client.patch(f"{A}/retention-classes/hinted", headers=AUTH,
                        json={"version": hinted.json()["version"], "conversation_hold_enabled": True})
    assert held.status_code == 200, held.text
    assert (held.json()["conversation_hold_enabled"], held.json()["hints_enabled"]) == (True, True)
    shown = client.get(f"{A}/retention-classes/hinted", headers=AUTH).json()
    assert shown["conversation_hold_enabled"] is True
    alone = client.post(f"{A}/retention-classes", json={"name": "held", "conversation_hold_enabled": True},
                        headers=AUTH)
    assert alone.status_code == 201 and (alone.json()["conversation_hold_enabled"], alone.json()["hints_enabled"]) == (
        True, False)
    for value in (1, "yes", None):  # a flag takes true or false only (null is not "no change" for it)
        bad = client.patch(f"{A}/retention-classes/held", headers=AUTH,
                           json={"version": alone.json()["version"], "conversation_hold_enabled": value})
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["field"] == "conversation_hold_enabled"


def test_the_end_demote_has_its_own_switch_off_by_default_apart_from_the_hold(client) -> None:  # type: ignore[no-untyped-def]
    held = client.post(f"{A}/retention-classes", headers=AUTH,
                       json={"name": "held", "hints_enabled": True, "conversation_hold_enabled": True})
    assert held.status_code == 201, held.text
    assert held.json()["conversation_end_demote_enabled"] is False  # the hold on does not turn the end demote on
    ended = client.post(f"{A}/retention-classes", json={"name": "ended", "conversation_end_demote_enabled": True},
                        headers=AUTH)
    assert ended.status_code == 201, ended.text
    assert (ended.json()["conversation_end_demote_enabled"], ended.json()["conversation_hold_enabled"],
            ended.json()["hints_enabled"]) == (True, False, False)
    off = client.patch(f"{A}/retention-classes/ended", headers=AUTH,
                       json={"version": ended.json()["version"], "conversation_end_demote_enabled": False})
    assert off.status_code == 200 and off.json()["conversation_end_demote_enabled"] is False, off.text
    assert client.get(f"{A}/retention-classes/ended", headers=AUTH).json()["conversation_end_demote_enabled"] is False
    for value in (1, "yes", None):  # a flag takes true or false only (null is not "no change" for it)
        bad = client.patch(f"{A}/retention-classes/ended", headers=AUTH,
                           json={"version": off.json()["version"], "conversation_end_demote_enabled": value})
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["field"] == "conversation_end_demote_enabled"
    bad = client.post(f"{A}/retention-classes", json={"name": "bad", "conversation_end_demote_enabled": "true"},
                      headers=AUTH)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "conversation_end_demote_enabled", bad.text


def test_the_service_refuses_a_non_boolean_switch(session) -> None:  # type: ignore[no-untyped-def]
    from tenants import retention_classes
    from tenants.errors import InvalidField
    from tests.tenants.factories import now

    with pytest.raises(InvalidField) as err:
        retention_classes.create_class(session, actor="t", now=now(), name="x", conversation_hold_enabled="on")
    assert err.value.field == "conversation_hold_enabled"
    with pytest.raises(InvalidField) as err:
        retention_classes.create_class(session, actor="t", now=now(), name="x", conversation_end_demote_enabled=0)
    assert err.value.field == "conversation_end_demote_enabled"
