"""`kvgate trace`, `admin apply`, `admin slo set`, `admin pools list` and `serve`: what they refuse and how they print."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import create_cli
from tests.server.admin.test_cli import run  # noqa: F401 - the fixture


def _captures(tmp_path: Path) -> Path:
    pool = tmp_path / "traces" / "p"
    pool.mkdir(parents=True)
    lines = [{"timestamp": t, "input_length": 4, "output_length": 1, "hash_ids": [t], "block_size": 4} for t in (100, 200)]
    (pool / "capture-000001-h1-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return pool


def _export(tmp_path: Path, out: Path, *extra: str):  # noqa: ANN202
    return CliRunner().invoke(create_cli(), ["trace", "export", "--pool", "p", "--dir", str(tmp_path / "traces"),
                                             "-o", str(out), *extra])


def test_export_refuses_its_own_input_and_the_capture_directory(tmp_path: Path) -> None:
    pool = _captures(tmp_path)
    capture = pool / "capture-000001-h1-1.jsonl"
    before = capture.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(capture)
    for out, needle in ((capture, "one of the capture files"), (link, "one of the capture files"),
                        (pool / "hour.jsonl", "inside the pool's capture directory"),
                        (pool / "sub" / "hour.jsonl", "inside the pool's capture directory")):
        result = _export(tmp_path, out)
        assert result.exit_code == 2, (out, result.output)
        assert needle in result.stderr, (out, result.stderr)
    assert capture.read_bytes() == before
    assert sorted(p.name for p in pool.iterdir()) == [capture.name]


def test_a_failed_export_leaves_an_existing_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _captures(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    out.chmod(0o640)

    def broken_replace(src, dst):  # noqa: ANN001, ANN202 - the rename fails (e.g. a full disk)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    result = _export(tmp_path, out)
    assert result.exit_code == 2 and "No space left" in result.stderr, result.output
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "traces"]  # no temporary file left
    monkeypatch.undo()
    result = _export(tmp_path, out)
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["timestamp"] for x in out.read_text().splitlines()] == [100, 200]
    assert out.stat().st_mode & 0o777 == 0o640  # a replaced file keeps its mode


def _rfc3339_utc(value: str) -> bool:
    return "T" in value and value.endswith("Z") and "+00:00" not in value


def test_trace_start_stop_list_print_times_as_the_admin_api(run) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=h:1",
        "--set", "primary_blocks=8")
    started = json.loads(run("trace", "start", "gpu-a").output)
    assert _rfc3339_utc(started["started_at"]) and started["stopped_at"] is None, started
    stopped = json.loads(run("trace", "stop", "gpu-a", str(started["id"])).output)
    assert _rfc3339_utc(stopped["stopped_at"]) and stopped["started_at"] == started["started_at"], stopped
    (listed,) = json.loads(run("trace", "list", "gpu-a").output)["items"]
    assert listed == stopped


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "null\n"])
def test_apply_refuses_a_file_without_a_registry(run, tmp_path: Path, text: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=h:1",
        "--set", "primary_blocks=8")
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    result = run("admin", "apply", "-f", str(empty), "--dry-run", "--exit-code", code=2)
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "invalid_file" and "holds no registry" in error["message"]
    assert "no changes" not in result.output


def test_slo_set_needs_a_threshold(run) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=h:1",
        "--set", "primary_blocks=8")
    for extra in ([], ["--set", "window_seconds=30"], ["--set", "ttft_p99_ms=null", "--set", "itl_p99_ms=null"]):
        error = json.loads(run("admin", "slo", "set", "gpu-a", *extra, code=2).stderr)["error"]
        assert "ttft_p99_ms" in error["message"] and "itl_p99_ms" in error["message"], extra
    assert json.loads(run("admin", "slo", "show", "gpu-a", code=1).stderr)["error"]["code"] == "slo_budget_not_found"
    made = json.loads(run("admin", "slo", "set", "gpu-a", "--set", "itl_p99_ms=60").output)
    assert (made["ttft_p99_ms"], made["itl_p99_ms"]) == (None, 60)
    help_text = " ".join(run("admin", "slo", "set", "--help").output.split())
    assert "At least one threshold, which has no default" in help_text


def test_an_unmigrated_database_suggests_db_upgrade(run) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    error = json.loads(run("admin", "pools", "list", code=1).stderr)["error"]
    assert "no such table" in error["message"] and "kvgate db upgrade" in error["message"]


def test_serve_names_the_port_option_it_was_given(run, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = run("serve", "--no-migrate", "--port", "70000", code=2)
    assert "--port: " in result.output and "KVGATE_PORT" not in result.output
    monkeypatch.setenv("KVGATE_PORT", "70000")
    assert "KVGATE_PORT: " in run("serve", "--no-migrate", code=2).output
