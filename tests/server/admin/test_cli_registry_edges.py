"""`kvgate admin` at the registry's edges, over a real SQLite file: ids no row can have are
"not found" (never a traceback), `apply` settles on empty caps, refuses SLO budgets past the
admin API's bounds and a prune that would strand a tenant-admin credential; `--exit-code` tells
drift apart."""

from __future__ import annotations

import json

from tests.server.admin.test_cli import run  # noqa: F401 - the fixture

BASE = """
pools:
  - {name: gpu-a, model_name: m, primary_blocks: 128, replicas: [{name: r0, endpoint: "127.0.0.1:8001"}]}
retention_classes:
  - {name: gold}
tenants:
  - {slug: acme, pool: gpu-a, retention_class: gold, limit_caps: {rpm_limit: 1000}}
  - {slug: beta, pool: gpu-a, retention_class: gold, limit_caps: {}}
"""


def test_ids_no_row_can_have_are_not_found(run) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=127.0.0.1:8001",
        "--set", "primary_blocks=64")
    run("admin", "classes", "create", "gold")
    run("admin", "tenants", "create", "acme", "--pool", "gpu-a", "--class", "gold")
    for huge in (str(2**31), str(2**63)):
        out = run("admin", "keys", "revoke", "acme", huge, code=1).output
        assert '"code": "api_key_not_found"' in out and "Traceback" not in out, out
        for command in (("show", huge), ("revoke", huge), ("rotate", huge)):
            out = run("admin", "credentials", *command, code=1).output
            assert '"code": "admin_credential_not_found"' in out and "Traceback" not in out, out


def test_apply_settles_refuses_big_budgets_and_stranding_prunes(run, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    registry = tmp_path / "registry.yaml"
    registry.write_text(BASE)
    assert "4 change(s): 4 create" in run("admin", "apply", "-f", str(registry)).output
    assert "no changes" in run("admin", "apply", "-f", str(registry)).output  # limit_caps: {} settled
    events = json.loads(run("admin", "audit").output)["total"]

    big = tmp_path / "big.yaml"
    big.write_text(BASE.replace('"127.0.0.1:8001"}]}', '"127.0.0.1:8001"}], slo: {ttft_p99_ms: 3000000000}}'))
    out = run("admin", "apply", "-f", str(big), code=2).output
    assert "pools[0].slo.ttft_p99_ms" in out, out

    created = json.loads(run("admin", "credentials", "create", "acme-ops", "--role", "tenant-admin",
                             "--tenant", "acme").output)
    run("admin", "keys", "create", "acme")
    pruned = tmp_path / "pruned.yaml"
    pruned.write_text(BASE.replace("  - {slug: acme, pool: gpu-a, retention_class: gold, limit_caps: {rpm_limit: 1000}}\n",
                                   ""))
    out = run("admin", "apply", "-f", str(pruned), "--prune", code=1).output
    assert '"code": "prune_orphans_credential"' in out and "acme-ops" in out and "revoke" in out, out
    assert json.loads(run("admin", "audit").output)["total"] == events + 2  # the credential and the key only
    run("admin", "credentials", "revoke", str(created["id"]))
    out = run("admin", "apply", "-f", str(pruned), "--prune", "--dry-run").output
    assert "- tenant acme\n    pool: \"gpu-a\"\n    api_keys: 1\n    usage_minutes: 0\n    stored_responses: 0\n" in out
    assert "- tenant acme" in run("admin", "apply", "-f", str(pruned), "--prune").output


def test_apply_exit_code_tells_ci_whether_the_registry_drifted(run, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    registry = tmp_path / "registry.yaml"
    registry.write_text(BASE)
    assert "4 create" in run("admin", "apply", "-f", str(registry), "--dry-run").output  # default: 0 either way
    out = run("admin", "apply", "-f", str(registry), "--dry-run", "--exit-code", code=3).output
    assert "4 change(s): 4 create" in out and "dry run: nothing written" in out
    assert json.loads(run("admin", "audit").output)["total"] == 0
    assert "applied as" in run("admin", "apply", "-f", str(registry), "--exit-code", code=3).output
    assert "no changes" in run("admin", "apply", "-f", str(registry), "--dry-run", "--exit-code").output  # 0
    registry.write_text(BASE.replace("primary_blocks: 128", "primary_blocks: 256"))
    assert "primary_blocks: 128 → 256" in run("admin", "apply", "-f", str(registry), "--dry-run", "--exit-code",
                                             code=3).output
    registry.write_text(BASE.replace("primary_blocks: 128", "primary_blocks: -1"))
    run("admin", "apply", "-f", str(registry), "--dry-run", "--exit-code", code=2)  # errors keep their codes
