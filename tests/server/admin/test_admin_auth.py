"""Admin auth: bearer tokens from settings, constant-time comparison, no placeholder tokens."""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings, SettingsError, with_dev_admin_token
from tests.server.admin.conftest import ADMIN_TOKEN, AUTH, OTHER_TOKEN, PEPPER, make_settings

A = "/admin/v1"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-xxxxxxxxxxxx"},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
        {"Authorization": "Bearer "},
    ],
)
def test_requests_without_a_valid_token_are_401(client, headers) -> None:  # type: ignore[no-untyped-def]
    for method, path in (("get", "/pools"), ("post", "/pools"), ("get", "/audit"), ("delete", "/tenants/x")):
        r = client.request(method, f"{A}{path}", headers=headers, json={})
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"


def test_each_token_maps_to_an_actor_id_not_the_token(client) -> None:  # type: ignore[no-untyped-def]
    client.post(f"{A}/retention-classes", headers=AUTH, json={"name": "a"})
    client.post(f"{A}/retention-classes", headers={"Authorization": f"Bearer {OTHER_TOKEN}"}, json={"name": "b"})
    events = client.get(f"{A}/audit", headers=AUTH).json()["items"]
    actors = [e["actor"] for e in events]
    assert actors[1] == "admin:ops" and actors[0].startswith("admin:") and actors[0] != "admin:ops"
    assert OTHER_TOKEN not in str(events) and ADMIN_TOKEN not in str(events)


def test_an_unnamed_tokens_actor_reveals_nothing_of_the_token(db) -> None:  # type: ignore[no-untyped-def]
    """Every role that reads the audit log sees actors: a digest of the token there would let
    a dictionary recover a passphrase token. A bare token is known by its place in the list."""
    passphrase = "Correct-Horse-Battery-Staple-2024!"
    settings = make_settings(db, admin_tokens=[f"ops:{ADMIN_TOKEN}", passphrase, OTHER_TOKEN])
    assert [actor for actor, _ in settings.admin_credentials()] == ["admin:ops", "admin:token-2", "admin:token-3"]
    assert settings.admin_credentials() == make_settings(db, admin_tokens=settings.admin_tokens).admin_credentials()
    with TestClient(create_app(settings, session_factory=db.factory)) as c:
        r = c.post(f"{A}/retention-classes", headers={"Authorization": f"Bearer {passphrase}"}, json={"name": "gold"})
        assert r.status_code == 201, r.text
        viewer = c.post(f"{A}/credentials", headers=AUTH, json={"name": "v", "role": "viewer"}).json()["secret"]
        (event,) = c.get(f"{A}/audit?entity_type=retention_class",
                         headers={"Authorization": f"Bearer {viewer}"}).json()["items"]
    assert event["actor"] == "admin:token-2"
    for digest in (hashlib.sha256(passphrase.encode()).hexdigest(),
                   hashlib.sha256(f"admin:{passphrase}".encode()).hexdigest()):
        assert not any(digest[:n] in event["actor"] for n in range(4, len(digest) + 1)), event["actor"]
    assert passphrase not in str(event)


def test_two_tokens_recorded_as_one_actor_are_refused_at_start() -> None:
    """The audit log must tell every token's changes apart: a name repeated, or a name that is a bare
    token's place ("token-1" beside a bare first token), is refused, naming the entry."""
    from pydantic import ValidationError

    from server.settings import settings_errors

    for tokens in ([f"ops:{ADMIN_TOKEN}", f"ops:{OTHER_TOKEN}"], [ADMIN_TOKEN, f"token-1:{OTHER_TOKEN}"]):
        with pytest.raises(ValidationError) as refused:
            Settings(admin_tokens=tokens, key_pepper=PEPPER)
        line = settings_errors(refused.value)
        assert line.startswith("KVGATE_ADMIN_TOKENS: ") and "entry 2" in line, line
        assert ADMIN_TOKEN not in line and OTHER_TOKEN not in line
    assert len(Settings(admin_tokens=[ADMIN_TOKEN, f"token-1x:{OTHER_TOKEN}"], key_pepper=PEPPER).admin_credentials()) == 2


@pytest.mark.parametrize("tokens", ["", "changeme", "ops:changeme", "short", f"{ADMIN_TOKEN},changeme"])
def test_app_refuses_placeholder_tokens_outside_dev(db, tokens: str) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(database_url=db.url, admin_tokens=tokens, key_pepper=PEPPER)
    with pytest.raises(SettingsError):
        create_app(settings, session_factory=db.factory)


@pytest.mark.parametrize("pepper", ["", "changeme", "tiny"])
def test_app_refuses_placeholder_pepper_outside_dev(db, pepper: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SettingsError):
        create_app(make_settings(db, key_pepper=pepper), session_factory=db.factory)


def test_dev_mode_generates_and_reuses_a_token_file(db, tmp_path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "dev-token"
    settings, token = with_dev_admin_token(Settings(database_url=db.url, dev=True), token_file=token_file)
    assert token and token_file.read_text().strip() == token and oct(token_file.stat().st_mode)[-3:] == "600"
    again, token2 = with_dev_admin_token(Settings(database_url=db.url, dev=True), token_file=token_file)
    assert token2 == token
    with TestClient(create_app(settings, session_factory=db.factory)) as c:
        assert c.get(f"{A}/pools", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert c.get(f"{A}/pools", headers=AUTH).status_code == 401
    prod = Settings(database_url=db.url, admin_tokens=f"ops:{ADMIN_TOKEN}", key_pepper=PEPPER)
    assert with_dev_admin_token(prod, token_file=tmp_path / "unused") == (prod, None)
    assert not (tmp_path / "unused").exists()


def test_settings_from_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVGATE_ADMIN_TOKENS", f"ops:{ADMIN_TOKEN}, {OTHER_TOKEN}")
    monkeypatch.setenv("KVGATE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    s = Settings()
    assert [actor for actor, _ in s.admin_credentials()][0] == "admin:ops"
    assert [token for _, token in s.admin_credentials()] == [ADMIN_TOKEN, OTHER_TOKEN]
    assert ADMIN_TOKEN not in repr(s)
    assert Settings(_env_file=None).database_url.startswith("postgresql://")
    monkeypatch.delenv("KVGATE_DATABASE_URL")
    assert Settings().database_url == "sqlite:///./kvgate.db"
