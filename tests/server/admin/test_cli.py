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


@pytest.mark.parametrize("args,env,trusted", [
    ((), {}, None),  # uvicorn's default: X-Forwarded-* believed from this host only
    (("--forwarded-allow-ips", "10.42.0.0/16"), {}, "10.42.0.0/16"),
    ((), {"KVGATE_FORWARDED_ALLOW_IPS": "10.42.0.5, fd00::/8"}, "10.42.0.5, fd00::/8"),
])
def test_serve_passes_the_trusted_proxies_to_uvicorn(run, monkeypatch, args, env, trusted) -> None:  # type: ignore[no-untyped-def]
    from server.gateway.drain import DrainingServer

    monkeypatch.setenv("KVGATE_ADMIN_TOKENS", "ops:cli-test-admin-token-0123456789")
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = []
    monkeypatch.setattr(DrainingServer, "run", lambda self: seen.append(self.config))
    run("serve", "--no-migrate", "--no-engine", "--no-seed-demo", *args)
    (config,) = seen
    config.load()  # where uvicorn resolves the trusted addresses and wraps the app in its proxy middleware
    if trusted is None:
        import uvicorn

        trusted = uvicorn.Config(app=None).forwarded_allow_ips
        assert set(trusted.split(",")) <= {"127.0.0.1", "::1"}
    assert config.proxy_headers and config.forwarded_allow_ips == trusted


def test_serve_refuses_a_trusted_proxy_that_is_no_address(run, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVGATE_ADMIN_TOKENS", "ops:cli-test-admin-token-0123456789")
    result = run("serve", "--no-migrate", "--forwarded-allow-ips", "ingress-nginx", code=2)
    assert "refusing to start" in result.output and "--forwarded-allow-ips:" in result.output  # the option given
    assert "ingress-nginx" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("env,named", [
    ({"KVGATE_FIRST_TOKEN_TIMEOUT_S": "-1"}, "KVGATE_FIRST_TOKEN_TIMEOUT_S"),
    ({"KVGATE_BREAKER_OPEN_S": "2", "KVGATE_BREAKER_MAX_OPEN_S": "1"}, "breaker_max_open_s (1.0) must be >= breaker_open_s (2.0)"),
    ({"KVGATE_USAGE_JOURNAL_SYNC": "sometimes"}, "KVGATE_USAGE_JOURNAL_SYNC: Input should be 'fsync' or 'write'"),
])
def test_serve_names_an_invalid_setting_instead_of_a_traceback(run, monkeypatch, env, named) -> None:  # type: ignore[no-untyped-def]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = run("serve", "--no-migrate", code=2)
    assert "refusing to start" in result.output and named in result.output
    assert "Traceback" not in result.output


def test_breaker_settings_reach_the_routing_config(monkeypatch) -> None:
    from server.serving import routing_config
    from server.settings import Settings

    monkeypatch.setenv("KVGATE_BREAKER_OPEN_S", "1.5")
    monkeypatch.setenv("KVGATE_BREAKER_MAX_OPEN_S", "30")
    monkeypatch.setenv("KVGATE_FIRST_TOKEN_TIMEOUT_S", "7")
    monkeypatch.setenv("KVGATE_INTER_TOKEN_TIMEOUT_S", "11")
    config = routing_config(Settings())
    assert (config.breaker_open_s, config.breaker_max_open_s, config.first_token_timeout_s) == (1.5, 30.0, 7.0)
    assert config.inter_token_timeout_s == 11.0


@pytest.mark.parametrize("value,fsync", [(None, True), ("fsync", True), ("write", False)])
def test_the_usage_journal_sync_setting_reaches_the_journal(tmp_path, monkeypatch, value, fsync) -> None:
    from server.serving import build_serving_app
    from server.settings import Settings

    if value is None:
        monkeypatch.delenv("KVGATE_USAGE_JOURNAL_SYNC", raising=False)
    else:
        monkeypatch.setenv("KVGATE_USAGE_JOURNAL_SYNC", value)
    url = f"sqlite:///{tmp_path / 'sync.db'}"
    migrate.upgrade(url=url)
    settings = Settings(database_url=url, admin_tokens=["ci:cli-test-admin-token-0123456789"],
                        key_pepper="cli-test-pepper-0123456789abcdef", usage_journal_dir=tmp_path / "journal",
                        trace_dir=tmp_path / "traces")
    assert settings.usage_journal_sync == (value or "fsync")
    app = build_serving_app(settings, tokenizer_for=lambda pool: None)
    assert app.state.gateway.usage._journal._fsync is fsync


def test_replicas_commands(run) -> None:  # type: ignore[no-untyped-def]
    run("db", "upgrade")
    replicas = '[{"name": "r0", "endpoint": "engine-0:8001"}]'
    pool = json.loads(run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set",
                          f"replicas={replicas}", "--set", "primary_blocks=8").output)
    assert [r["name"] for r in pool["replicas"]] == ["r0"] and pool["triton_url"] == "engine-0:8001"
    added = json.loads(run("admin", "replicas", "add", "gpu-a", "r1", "--endpoint", "engine-1:8001",
                           "--weight", "2").output)
    assert (added["name"], added["weight"], added["state"]) == ("r1", 2, "active")
    assert [r["name"] for r in json.loads(run("admin", "replicas", "list", "gpu-a").output)] == ["r0", "r1"]
    updated = json.loads(run("admin", "replicas", "update", "gpu-a", "r1", "--version", "1", "--set",
                             "endpoint=engine-1b:8001").output)
    assert (updated["endpoint"], updated["version"]) == ("engine-1b:8001", 2)
    assert json.loads(run("admin", "replicas", "drain", "gpu-a", "r0").output)["state"] == "draining"
    assert json.loads(run("admin", "replicas", "disable", "gpu-a", "r0", "--version", "2").output)["state"] \
        == "disabled"
    assert "stale_version" in run("admin", "replicas", "activate", "gpu-a", "r0", "--version", "1", code=1).output
    assert json.loads(run("admin", "replicas", "activate", "gpu-a", "r0").output)["state"] == "active"
    assert "endpoint" in run("admin", "replicas", "add", "gpu-a", "r2", "--endpoint", "nope", code=2).output
    assert "replica_not_found" in run("admin", "replicas", "show", "gpu-a", "r9", code=1).output
    run("admin", "replicas", "remove", "gpu-a", "r0")
    last = run("admin", "replicas", "remove", "gpu-a", "r1", code=1)
    assert "last_replica" in last.output
    audit = json.loads(run("admin", "audit", "--entity-type", "pool_replica").output)
    assert [e["action"] for e in audit["items"]][::-1] == [
        "pool_replica.create", "pool_replica.update", "pool_replica.drain", "pool_replica.disable",
        "pool_replica.activate", "pool_replica.delete",
    ]


def test_admin_apply(run, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`kvgate admin apply -f`: dry run writes nothing, apply audits as the actor, twice is a no-op,
    a bad file exits 2 and writes nothing."""
    import getpass
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "deploy" / "registry.example.yaml"
    assert "kvgate db upgrade" in run("admin", "apply", "-f", str(example), code=1).output  # not migrated yet
    run("db", "upgrade")
    dry = run("admin", "apply", "-f", str(example), "--dry-run").output
    assert "+ pool reference" in dry and "+ tenant acme" in dry and "dry run: nothing written" in dry
    assert json.loads(run("admin", "audit").output)["total"] == 0
    applied = run("admin", "apply", "-f", str(example)).output
    assert applied == dry.replace("dry run: nothing written", f"applied as cli:{getpass.getuser()}")
    audit = json.loads(run("admin", "audit").output)
    assert audit["total"] == 5 and {e["actor"] for e in audit["items"]} == {f"cli:{getpass.getuser()}"}
    assert "no changes" in run("admin", "apply", "-f", str(example)).output
    assert json.loads(run("admin", "audit").output)["total"] == 5

    changed = tmp_path / "changed.yaml"
    changed.write_text(example.read_text().replace("rpm_limit: 60\n", "rpm_limit: 90\n"))
    out = run("admin", "apply", "-f", str(changed), "--actor", "helm:release-1").output
    assert "~ tenant nightly\n    rpm_limit: 60 → 90\n1 change(s): 1 update" in out
    newest = json.loads(run("admin", "audit", "--limit", "1").output)["items"][0]
    assert (newest["actor"], newest["action"], newest["after"]["rpm_limit"]) == ("cli:helm:release-1", "tenant.update",
                                                                                 90)

    bad = tmp_path / "bad.yaml"
    for text, needle in (
        ("tenants:\n  - {slug: x, pool: reference, retention_class: chat, api_keys: [k]}\n", "tenants[0].api_keys"),
        ("tenants:\n  - {slug: x, pool: nope, retention_class: chat}\n", "tenants[0].pool"),
        ("retention_classes:\n  - {name: c2, turn_priority: 101}\n", "retention_classes[0].turn_priority"),
        ("pools: [\n", "not valid YAML at line"),
    ):
        bad.write_text(text)
        result = run("admin", "apply", "-f", str(bad), code=2)
        assert needle in result.output, result.output
    assert "cannot read" in run("admin", "apply", "-f", str(tmp_path / "missing.yaml"), code=2).output
    assert json.loads(run("admin", "audit").output)["total"] == 6


def test_apply_actor_stays_in_the_cli_namespace(run, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--actor NAME` records `cli:NAME`, never another namespace; a control or formatting character is
    refused (exit 2, nothing written) as in a credential's name."""
    run("db", "upgrade")
    registry = tmp_path / "registry.yaml"
    registry.write_text("retention_classes:\n  - {name: gold}\n")
    for bad, char in (("admin:root\nforged", "U+000A"), ("ops\x1b[2J", "U+001B"), ("evil\u202egnp", "U+202E"),
                      ("a\u2028b", "U+2028"), ("x" * 125, None), (" ", None)):
        result = run("admin", "apply", "-f", str(registry), "--actor", bad, code=2)
        error = json.loads(result.stderr if hasattr(result, "stderr") else result.output)["error"]
        assert (error["code"], error["field"]) == ("invalid_value", "--actor"), error
        assert (char or "characters") in error["message"], error
    assert json.loads(run("admin", "audit").output)["total"] == 0
    out = run("admin", "apply", "-f", str(registry), "--actor", "admin:root").output
    assert "applied as cli:admin:root" in out
    (event,) = json.loads(run("admin", "audit").output)["items"]
    assert (event["actor"], event["action"]) == ("cli:admin:root", "retention_class.create")
    registry.write_text("retention_classes:\n  - {name: gold}\n  - {name: silver}\n")
    run("admin", "apply", "-f", str(registry), "--actor", "x" * 124)  # the longest name fits the actor column
    assert json.loads(run("admin", "audit", "--limit", "1").output)["items"][0]["actor"] == "cli:" + "x" * 124


@pytest.mark.postgres
def test_admin_apply_on_postgres(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same command against PostgreSQL, by URL from KVGATE_DATABASE_URL as a Helm Job runs it."""
    from pathlib import Path

    from tests.tenants.fixtures import PG_ADMIN_URL, drop_pg_schema, new_pg_schema, postgres_reachable

    if not postgres_reachable():
        pytest.skip("PostgreSQL is unreachable")
    schema = new_pg_schema()
    monkeypatch.setenv("KVGATE_DATABASE_URL", f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}")
    runner, cli = CliRunner(), create_cli()
    example = str(Path(__file__).resolve().parents[3] / "deploy" / "registry.example.yaml")
    try:
        assert runner.invoke(cli, ["db", "upgrade"]).exit_code == 0
        first = runner.invoke(cli, ["admin", "apply", "-f", example, "--actor", "helm:kvgate"])
        assert first.exit_code == 0 and "5 change(s): 5 create" in first.output, first.output
        second = runner.invoke(cli, ["admin", "apply", "-f", example])
        assert second.exit_code == 0 and "no changes" in second.output
        bad = tmp_path / "bad.yaml"
        bad.write_text("tenants:\n  - {slug: x, pool: nope, retention_class: chat}\n")
        third = runner.invoke(cli, ["admin", "apply", "-f", str(bad)])
        assert third.exit_code == 2 and "tenants[0].pool" in third.output
        audit = json.loads(runner.invoke(cli, ["admin", "audit"]).output)
        assert audit["total"] == 5 and {e["actor"] for e in audit["items"]} == {"cli:helm:kvgate"}
    finally:
        drop_pg_schema(schema)


def test_classes_take_the_hint_fields(run) -> None:  # type: ignore[no-untyped-def]
    run("db", "upgrade")
    cls = json.loads(run("admin", "classes", "create", "agents", "--set", "hints_enabled=true",
                         "--set", "hint_max_ttl_ms=3600000", "--set", "hint_max_priority=70").output)
    assert (cls["hints_enabled"], cls["hint_max_priority"], cls["hint_quota_fraction"]) == (True, 70, 0.5)
    assert cls["conversation_hold_enabled"] is False  # its own switch
    held = json.loads(run("admin", "classes", "update", "agents", "--version", str(cls["version"]), "--set",
                          "conversation_hold_enabled=true").output)
    assert held["conversation_hold_enabled"] is True
    assert held["conversation_end_demote_enabled"] is False  # its own switch too
    ended = json.loads(run("admin", "classes", "update", "agents", "--version", str(held["version"]), "--set",
                           "conversation_end_demote_enabled=true").output)
    assert (ended["conversation_end_demote_enabled"], ended["conversation_hold_enabled"]) == (True, True)
    bad = run("admin", "classes", "update", "agents", "--version", "1", "--set", "hint_quota_fraction=2", code=2)
    assert "hint_quota_fraction" in bad.output + (bad.stderr or "")
