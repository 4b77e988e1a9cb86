"""`kvgate admin slo` over a real SQLite file: set, show, replace with a version, bad input, delete."""

from __future__ import annotations

import json

from tests.server.admin.test_cli import run  # noqa: F401 - the fixture


def test_slo_budget_from_the_shell(run) -> None:  # type: ignore[no-untyped-def]
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=127.0.0.1:8001",
        "--set", "primary_blocks=64")
    made = json.loads(run("admin", "slo", "set", "gpu-a", "--set", "ttft_p99_ms=800", "--set", "window_seconds=30",
                          "--set", "pilot_fraction=0.5").output)
    assert (made["ttft_p99_ms"], made["window_seconds"], made["pilot_fraction"], made["version"]) == (800, 30, 0.5, 1)
    assert json.loads(run("admin", "slo", "show", "gpu-a").output) == made
    replaced = json.loads(run("admin", "slo", "set", "gpu-a", "--set", "itl_p99_ms=50", "--set", "enabled=false",
                              "--version", "1").output)
    assert (replaced["ttft_p99_ms"], replaced["itl_p99_ms"], replaced["enabled"], replaced["version"]) == (None, 50, False, 2)
    bad = run("admin", "slo", "set", "gpu-a", "--set", "hysteresis=1.5", code=2)
    assert json.loads(bad.stderr)["error"]["field"] == "hysteresis"
    stale = run("admin", "slo", "set", "gpu-a", "--set", "itl_p99_ms=50", "--version", "1", code=1)
    assert json.loads(stale.stderr)["error"]["code"] == "stale_version"
    run("admin", "slo", "delete", "gpu-a")
    missing = run("admin", "slo", "show", "gpu-a", code=1)
    assert json.loads(missing.stderr)["error"]["code"] == "slo_budget_not_found"
