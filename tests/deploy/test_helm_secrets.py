"""No secret in anything the chart renders; secrets reach the pods only through the Secret."""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import yaml

from tests.deploy.chart import Rendered, containers, gateway, pod_templates

# What the Secret would hold in a real install; none of it may appear in anything rendered.
TEST_SECRETS = {
    "admin-tokens": "ops:5f0c6c1e9a7b4d2e8f3a6b9c1d4e7f20",
    "key-pepper": "c8b1f4e2a9d7c3b6e5f8a1d4c7b0e3f6a9d2c5b8",
    "database-url": "postgresql+psycopg://kvgate:Pw-7d1e0b9c4a@db.internal:5432/kvgate",
    "postgres-password": "3b7e1f9d5c2a8e4b6d0f",
    "redis-url": "rediss://:Rp-9a8b7c6d5e@redis.internal:6380/0",
    "metrics-token": "m-4e2d9c7b1a5f3e8d6c0b",
    "hf-token": "hf_QwErTyUiOpAsDfGhJkLzXcVbNm",
}
SECRET_ENV = {"KVGATE_ADMIN_TOKENS", "KVGATE_KEY_PEPPER", "KVGATE_METRICS_TOKEN", "HF_TOKEN", "POSTGRES_PASSWORD",
              "KVGATE_POSTGRES_PASSWORD"}
URL_WITH_PASSWORD = re.compile(r"://[^/:@\s]*:(?!\$\()[^@\s]+@")


def leaks(r: Rendered) -> list[str]:
    """Every place a secret value (or a URL with a literal password) shows in the render."""
    found = []
    text = "\n".join(v for k, v in r.manifests.items())
    found += [f"value of {key}" for key, value in TEST_SECRETS.items() if value in text]
    found += [f"URL with a password: {m.group(0)}" for m in URL_WITH_PASSWORD.finditer(text)]
    for obj in r.objects:
        if obj["kind"] == "Secret":
            found.append(f"Secret/{obj['metadata']['name']}")
        for template in pod_templates(obj):
            for c in containers(template):
                for env in c.get("env", []):
                    if env["name"] in SECRET_ENV and "value" in env:
                        found.append(f"{obj['metadata']['name']}: {env['name']} inline")
    return found


def test_no_secret_is_rendered(rendered):
    assert leaks(rendered) == []
    for obj in rendered.objects:
        for template in pod_templates(obj):
            for c in containers(template):
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if env["name"] in SECRET_ENV | {"KVGATE_REDIS_URL"} and ref:
                        assert ref["name"] == "kvgate-secrets"
    for cm in rendered.of_kind("ConfigMap"):
        if cm["metadata"]["name"] == "kvgate-registry":
            registry = yaml.safe_load(cm["data"]["registry.yaml"])
            keys = {k for tenant in registry.get("tenants", []) for k in tenant}
            assert not keys & {"key", "keys", "api_key", "token", "secret"}


def test_the_leak_scan_can_fail(renders):
    r = renders["cpu-trial"]
    leaked = copy.deepcopy(r.manifests)
    path = next(k for k in leaked if k.endswith("registry-configmap.yaml"))
    leaked[path] += f"\n# {TEST_SECRETS['key-pepper']}\n"
    assert leaks(Rendered(values=r.values, manifests=leaked)) == ["value of key-pepper"]
    doc = "kind: ConfigMap\nmetadata: {name: x}\ndata: {url: 'postgresql://kvgate:%s@db/kvgate'}\n"
    assert leaks(Rendered(values={}, manifests={"x.yaml": doc % "hunter2"}))
    assert not leaks(Rendered(values={}, manifests={"x.yaml": doc % "$(KVGATE_POSTGRES_PASSWORD)"}))


VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolve_env(container: dict[str, Any], secret: dict[str, str]) -> dict[str, str]:
    """What the kubelet gives the container: secretKeyRef from ``secret``, then $(VAR) expansion
    of variables defined earlier in the list (Kubernetes dependent environment variables)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "kvgate-secrets"
            env[item["name"]] = secret[ref["key"]]
    return env


def test_secrets_reach_the_settings_only_at_run_time(renders, monkeypatch):
    """Resolved as the kubelet would, the gateway's environment is a valid production
    configuration for the real Settings — and none of those values is in the render."""
    from server.settings import Settings

    for name, r in renders.items():
        (gateway,) = r.get("Deployment", "kvgate-gateway")["spec"]["template"]["spec"]["containers"]
        env = resolve_env(gateway, TEST_SECRETS)
        if r.values.get("postgres", {}).get("bundled"):
            want_db = f"postgresql+psycopg://kvgate:{TEST_SECRETS['postgres-password']}@kvgate-postgres:5432/kvgate"
        else:
            want_db = TEST_SECRETS["database-url"]
        assert env["KVGATE_DATABASE_URL"] == want_db, name
        for job in ("kvgate-migrate", "kvgate-registry-apply"):
            (c,) = r.get("Job", job)["spec"]["template"]["spec"]["containers"]
            assert resolve_env(c, TEST_SECRETS)["KVGATE_DATABASE_URL"] == want_db
        for key in [k for k in os.environ if k.startswith("KVGATE_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        settings.check_serving_secrets()  # real tokens and pepper, not dev mode
        assert settings.admin_credentials() == [("admin:ops", TEST_SECRETS["admin-tokens"].split(":", 1)[1])]
        assert settings.database_url == want_db and not settings.dev
        if r.values.get("redis", {}).get("mode") == "external":
            assert settings.redis_url == TEST_SECRETS["redis-url"]
        if r.values["secrets"].get("keys", {}).get("metricsToken"):
            assert settings.metrics_token == TEST_SECRETS["metrics-token"]
        assert leaks(r) == []


def test_database_url_comes_from_the_secret(renders):
    for name, r in renders.items():
        env = {e["name"]: e for e in gateway(r)[1]["env"]}
        url = env["KVGATE_DATABASE_URL"]
        if r.values.get("postgres", {}).get("bundled"):
            # composed by the kubelet from the password variable defined before it
            names = [e["name"] for e in gateway(r)[1]["env"]]
            assert names.index("KVGATE_POSTGRES_PASSWORD") < names.index("KVGATE_DATABASE_URL")
            assert url["value"] == "postgresql+psycopg://kvgate:$(KVGATE_POSTGRES_PASSWORD)@kvgate-postgres:5432/kvgate"
            assert env["KVGATE_POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "postgres-password"
        else:
            assert url["valueFrom"]["secretKeyRef"] == {"name": "kvgate-secrets", "key": "database-url"}, name
