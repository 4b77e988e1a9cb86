"""OIDC bearer tokens on the admin API: JWTs signed by keys the test generates (PyJWT +
cryptography), JWKS from a file and from a URL served on 127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from fastapi.testclient import TestClient

from server.app import create_app
from tests.server.admin.conftest import AUTH, make_settings, seed
from tests.server.admin.test_credentials import add_tenant, bearer

ISSUER = "https://idp.example.test/"
AUDIENCE = "kvgate-admin"
ROLE_MAP = {"kv-platform": "platform-admin", "kv-ops": "operator", "kv-tenant": "tenant-admin",
            "kv-read": "viewer"}


@pytest.fixture(scope="module")
def keys() -> dict[str, object]:
    return {"rsa": rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "ec": ec.generate_private_key(ec.SECP256R1()),
            "rogue": rsa.generate_private_key(public_exponent=65537, key_size=2048)}


def jwks(keys: dict[str, object]) -> str:
    out = []
    for kid, alg, algorithm in (("rsa-1", "RS256", jwt.algorithms.RSAAlgorithm),
                                ("ec-1", "ES256", jwt.algorithms.ECAlgorithm)):
        jwk = algorithm.to_jwk(keys["rsa" if alg == "RS256" else "ec"].public_key(), as_dict=True)  # type: ignore[attr-defined]
        out.append({**jwk, "kid": kid, "alg": alg, "use": "sig"})
    return json.dumps({"keys": out})


def token(keys: dict[str, object], *, key: str = "rsa", kid: str = "rsa-1", alg: str = "RS256",
          **claims: object) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, keys[key], algorithm=alg,  # type: ignore[arg-type]
                      headers={"kid": kid})


def oidc_client(db, **oidc: object) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = make_settings(db, oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_role_map=ROLE_MAP, **oidc)
    with TestClient(create_app(settings, session_factory=db.factory)) as c:
        seed(c)
        add_tenant(c, "globex")
        yield c


@pytest.fixture
def client_file(db, keys, tmp_path: Path) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    path = tmp_path / "jwks.json"
    path.write_text(jwks(keys))
    yield from oidc_client(db, oidc_jwks_file=path)


def test_roles_and_scopes_from_claims(client_file: TestClient, keys) -> None:  # type: ignore[no-untyped-def]
    c = client_file
    ops = bearer(token(keys, roles=["unrelated", "kv-ops"]))
    assert c.get("/admin/v1/whoami", headers=ops).json() == {"name": "oidc:alice", "role": "operator",
                                                             "tenants": None}
    assert c.get("/admin/v1/tenants/acme/keys", headers=ops).status_code == 403
    r = c.put("/admin/v1/pools/gpu-a/slo", headers=ops, json={"ttft_p99_ms": 900})
    assert r.status_code == 200, r.text
    events = c.get("/admin/v1/audit?entity_type=pool_slo", headers=AUTH).json()["items"]
    assert events[0]["actor"] == "oidc:alice"

    tenant_admin = bearer(token(keys, key="ec", kid="ec-1", alg="ES256", sub="bob", roles=["kv-tenant"],
                                kvgate_tenants=["acme", "no-such-tenant"]))
    assert c.get("/admin/v1/whoami", headers=tenant_admin).json() == {"name": "oidc:bob", "role": "tenant-admin",
                                                                      "tenants": ["acme"]}
    assert c.get("/admin/v1/tenants", headers=tenant_admin).json()["total"] == 1
    assert c.get("/admin/v1/tenants/globex", headers=tenant_admin).status_code == 404
    assert c.post("/admin/v1/tenants/acme/keys", headers=tenant_admin, json={}).status_code == 201
    # several mapped values: the most powerful role; a string claim works as a one-element list
    both = bearer(token(keys, roles=["kv-read", "kv-platform"]))
    assert c.get("/admin/v1/whoami", headers=both).json()["role"] == "platform-admin"
    assert c.get("/admin/v1/whoami", headers=bearer(token(keys, roles="kv-read"))).json()["role"] == "viewer"
    # so does a bare tenant: a viewer scoped by a string claim stays scoped, never reads every tenant
    for role in ("kv-read", "kv-tenant"):
        scoped = bearer(token(keys, roles=[role], kvgate_tenants="acme"))
        assert c.get("/admin/v1/whoami", headers=scoped).json()["tenants"] == ["acme"]
        assert c.get("/admin/v1/tenants/globex", headers=scoped).status_code == 404
        assert c.get("/admin/v1/tenants", headers=scoped).json()["total"] == 1
    # a scope claim of another shape cannot be read: refused, not taken for "no scope"
    for shape in ({"acme": True}, 7, True):
        r = c.get("/admin/v1/whoami", headers=bearer(token(keys, roles=["kv-read"], kvgate_tenants=shape)))
        assert r.status_code == 401, (shape, r.text)


def test_bad_tokens_are_401(client_file: TestClient, keys) -> None:  # type: ignore[no-untyped-def]
    public_pem = keys["rsa"].public_key().public_bytes(  # type: ignore[attr-defined]
        encoding=serialization.Encoding.PEM, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "eve", "exp": now + 300, "roles": ["kv-platform"]}
    bad = {
        "wrong audience": token(keys, aud="someone-else", roles=["kv-platform"]),
        "wrong issuer": token(keys, iss="https://evil.test/", roles=["kv-platform"]),
        "expired": token(keys, exp=now - 10, roles=["kv-platform"]),
        "no exp": token(keys, exp=None, roles=["kv-platform"]),
        "foreign key, known kid": token(keys, key="rogue", roles=["kv-platform"]),
        "unknown kid": token(keys, kid="nope", roles=["kv-platform"]),
        "alg none": jwt.encode(base, None, algorithm="none", headers={"kid": "rsa-1"}),
        "HS256 with the public key": _hs256_forgery(base, public_pem),
        "RS256 header over the EC key's kid": token(keys, key="rsa", kid="ec-1", alg="RS256", roles=["kv-platform"]),
        "ES256 header over the RSA key's kid": token(keys, key="ec", kid="rsa-1", alg="ES256", roles=["kv-platform"]),
        "unmapped role": token(keys, roles=["kv-unknown"]),
        "tenant-admin without tenants": token(keys, roles=["kv-tenant"]),
    }
    for why, presented in bad.items():
        r = client_file.get("/admin/v1/whoami", headers=bearer(presented))
        assert r.status_code == 401, (why, r.text)


def _hs256_forgery(claims: dict, secret: bytes) -> str:
    """The algorithm-confusion attack: HS256 keyed with the RSA public key (PyJWT itself
    refuses to sign this, so the attacker's side is built from the stdlib)."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
    body = b64(json.dumps(claims).encode())
    sig = b64(hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest())
    return f"{head}.{body}.{sig}"


class _Jwks(http.server.BaseHTTPRequestHandler):
    body = b""
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_jwks_from_a_url(db, keys) -> None:  # type: ignore[no-untyped-def]
    handler = type("Handler", (_Jwks,), {"body": jwks(keys).encode(), "hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/.well-known/jwks.json"
        for c in oidc_client(db, oidc_jwks_url=url):
            assert c.get("/admin/v1/whoami", headers=bearer(token(keys, roles=["kv-ops"]))).json()["role"] == "operator"
            ec_token = token(keys, key="ec", kid="ec-1", alg="ES256", roles=["kv-read"])
            assert c.get("/admin/v1/whoami", headers=bearer(ec_token)).json()["role"] == "viewer"
            rogue = token(keys, key="rogue", roles=["kv-platform"])
            assert c.get("/admin/v1/whoami", headers=bearer(rogue)).status_code == 401
            assert handler.hits >= 1
    finally:
        server.shutdown()
        server.server_close()


def test_oidc_settings_are_checked_and_read_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from server.settings import Settings

    with pytest.raises(ValidationError, match="oidc_jwks_file or oidc_jwks_url"):
        Settings(oidc_issuer=ISSUER, oidc_audience=AUDIENCE)
    with pytest.raises(ValidationError, match="oidc_audience"):
        Settings(oidc_issuer=ISSUER, oidc_jwks_url="http://127.0.0.1:1/jwks")
    with pytest.raises(ValidationError):
        Settings(oidc_role_map={"x": "root"})
    monkeypatch.setenv("KVGATE_OIDC_ISSUER", ISSUER)
    monkeypatch.setenv("KVGATE_OIDC_AUDIENCE", AUDIENCE)
    monkeypatch.setenv("KVGATE_OIDC_JWKS_FILE", str(tmp_path / "jwks.json"))
    monkeypatch.setenv("KVGATE_OIDC_ROLE_MAP", '{"kv-ops": "operator"}')
    settings = Settings()
    assert settings.oidc_enabled and settings.oidc_role_map == {"kv-ops": "operator"}
    assert not Settings(_env_file=None, oidc_issuer=None).oidc_enabled


def _with_claims(keys: dict[str, object], **claims: object) -> str:
    """A token with ``claims`` exactly (``token`` drops None values; this keeps a JSON null)."""
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "carol", "iat": now, "exp": now + 300, **claims}
    return jwt.encode(body, keys["rsa"], algorithm="RS256", headers={"kid": "rsa-1"})  # type: ignore[arg-type]


def test_a_viewer_without_a_readable_scope_reads_no_tenant(client_file: TestClient, keys) -> None:  # type: ignore[no-untyped-def]
    """No tenants claim: a viewer scoped to no tenant (once unscoped: every tenant, the audit log).
    A null claim: unreadable, refused like any other shape. A tenant-admin needs tenants either way."""
    c = client_file
    key = c.post("/admin/v1/tenants/globex/keys", headers=AUTH, json={"name": "globex-prod"})
    assert key.status_code == 201, key.text
    nobody = bearer(_with_claims(keys, roles=["kv-read"]))
    assert c.get("/admin/v1/whoami", headers=nobody).json() == {"name": "oidc:carol", "role": "viewer",
                                                                "tenants": []}
    assert c.get("/admin/v1/tenants", headers=nobody).json()["total"] == 0
    for path in ("/admin/v1/tenants/globex/keys", "/admin/v1/tenants/acme"):
        assert c.get(path, headers=nobody).status_code == 404, path
    for path in ("/admin/v1/audit", "/admin/v1/pools"):
        assert c.get(path, headers=nobody).status_code == 403, path
    for role in ("kv-read", "kv-tenant", "kv-ops", "kv-platform"):
        r = c.get("/admin/v1/whoami", headers=bearer(_with_claims(keys, roles=[role], kvgate_tenants=None)))
        assert r.status_code == 401, (role, r.text)
    assert c.get("/admin/v1/whoami", headers=bearer(_with_claims(keys, roles=["kv-tenant"]))).status_code == 401
    # operators and platform admins are never scoped: no claim is what they send
    ops = bearer(_with_claims(keys, roles=["kv-ops"]))
    assert c.get("/admin/v1/whoami", headers=ops).json()["tenants"] is None


def test_a_name_too_long_for_the_actor_is_refused(client_file: TestClient, keys) -> None:  # type: ignore[no-untyped-def]
    """``oidc:<name>`` fits the 128-char actor whole: two long subjects were once cut into one actor."""
    fits = "s" * 123
    r = client_file.get("/admin/v1/whoami", headers=bearer(token(keys, sub=fits, roles=["kv-ops"])))
    assert r.status_code == 200 and r.json()["name"] == f"oidc:{fits}"
    for sub in (fits + "a", fits + "b"):
        r = client_file.get("/admin/v1/whoami", headers=bearer(token(keys, sub=sub, roles=["kv-ops"])))
        assert r.status_code == 401, r.text


def test_a_name_with_control_or_format_characters_is_refused(client_file: TestClient, keys) -> None:  # type: ignore[no-untyped-def]
    """As for credential names: the actor is shown in logs, the audit log and the console, where a
    bidi override or a newline would make one name read as another."""
    for sub in ("ops\u202eknil", "ops\nadmin", "ops\u200b", "ops\u2028x"):
        r = client_file.get("/admin/v1/whoami", headers=bearer(token(keys, sub=sub, roles=["kv-ops"])))
        assert r.status_code == 401, (sub, r.text)
    r = client_file.get("/admin/v1/whoami", headers=bearer(token(keys, sub="opérateur", roles=["kv-ops"])))
    assert r.status_code == 200 and r.json()["name"] == "oidc:opérateur"  # letters of any script are fine
