"""`kvgate db` and `kvgate admin` over a real SQLite file, through Typer's runner."""

from __future__ import annotations

from tenants import migrate

import json

import pytest
from typer.testing import CliRunner

from server.cli import create_cli


@pytest.fixture
def run(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.setenv("KVGATE_KEY_PEPPER", "cli-test-pepper-0123456789abcdef")
    monkeypatch.delenv("KVGATE_DEV", raising=False)
    runner = CliRunner()
    cli = create_cli()

    def invoke(*args: str, code: int = 0):  # type: ignore[no-untyped-def]
        result = runner.invoke(cli, list(args))
        assert result.exit_code == code, (args, result.output, result.stderr if hasattr(result, "stderr") else "")
        return result

    return invoke


def test_db_and_admin_round_trip(run) -> None:  # type: ignore[no-untyped-def]
    assert f"revision {migrate.head()}" in run("db", "upgrade").output
    pool = json.loads(
        run(
            "admin",
            "pools",
            "create",
            "gpu-a",
            "--set",
            "model_name=smollm2",
            "--set",
            "triton_url=127.0.0.1:8001",
            "--set",
            "primary_blocks=64",
            "--set",
            "secondary_blocks=64",
        ).output
    )
    assert pool["name"] == "gpu-a" and pool["secondary_offload_min_priority"] == 35
    run("admin", "classes", "create", "gold", "--set", "turn_priority=10", "--set", "turn_duration_ms=null")
    tenant = json.loads(run("admin", "tenants", "create", "acme", "--pool", "gpu-a", "--class", "gold").output)
    assert {s["segment"]: s["tier_on_eviction"] for s in tenant["retention_view"]}["turn"] == "dropped"
    key = json.loads(run("admin", "keys", "create", "acme", "--name", "ci").output)
    assert key["key"].startswith(f"kvg_{key['prefix']}_")
    listed = json.loads(run("admin", "keys", "list", "acme").output)
    assert listed["total"] == 1 and "key" not in listed["items"][0]
    run("admin", "keys", "revoke", "acme", str(key["id"]))
    updated = json.loads(run("admin", "tenants", "update", "acme", "--version", "1", "--set", "rpm_limit=5").output)
    assert (updated["rpm_limit"], updated["version"]) == (5, 2)
    stale = run("admin", "tenants", "update", "acme", "--version", "1", "--set", "rpm_limit=6", code=1)
    assert "stale_version" in stale.output
    bad = run(
        "admin",
        "pools",
        "create",
        "p2",
        "--set",
        "model_name=m",
        "--set",
        "triton_url=h:1",
        "--set",
        "primary_blocks=0",
        code=2,
    )
    assert "primary_blocks" in bad.output
    in_use = run("admin", "pools", "delete", "gpu-a", code=1)
    assert "pool_in_use" in in_use.output
    audit = json.loads(run("admin", "audit", "--limit", "500").output)
    assert audit["total"] == 6 and all(e["actor"].startswith("cli:") for e in audit["items"])
    assert f"current: {migrate.head()}" in run("db", "current").output
    assert "revision base" in run("db", "downgrade", "base").output


def test_serve_refuses_placeholder_secrets(run, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVGATE_ADMIN_TOKENS", "changeme")
    result = run("serve", "--no-migrate", code=2)
    assert "refusing to start" in result.output
