"""Bad database URLs, settings and server options: one clear line on stderr and a non-zero exit.

``kvgate db``, ``kvgate admin``, ``kvgate serve`` and ``kvgate engine serve`` report each
error the way the command reports its others (the admin JSON error shape, or the
``kvgate serve: ...`` line), never with a traceback.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from server.cli import create_cli


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(create_cli(), list(args), env=env)


def one_line(result: Any, exit_code: int) -> str:
    """The single stderr line of a command that exited cleanly with ``exit_code``."""
    assert result.exit_code == exit_code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # typer.Exit, not an uncaught error
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def json_error(result: Any, exit_code: int) -> dict[str, Any]:
    return json.loads(one_line(result, exit_code))["error"]


@pytest.mark.parametrize("command", [["db", "current"], ["db", "upgrade"], ["db", "downgrade", "base"]])
def test_db_refuses_an_unparsable_url(command: list[str]) -> None:
    error = json_error(invoke(*command, "--database-url", "notaurl"), 2)
    assert error["code"] == "invalid_value" and error["field"] == "--database-url"
    assert "not a database URL" in error["message"]


@pytest.mark.parametrize("command", [["db", "current"], ["db", "upgrade"]])
def test_db_reports_an_unreachable_database(command: list[str], tmp_path: Path) -> None:
    error = json_error(invoke(*command, "--database-url", f"sqlite:///{tmp_path}/missing/dir/x.db"), 1)
    assert error["code"] == "database_unavailable" and "unable to open database file" in error["message"]
    error = json_error(invoke(*command, "--database-url", "postgresql://127.0.0.1:1/x"), 1)
    assert error["code"] == "database_unavailable" and "127.0.0.1" in error["message"]


@pytest.mark.parametrize("command", ["upgrade", "downgrade"])
def test_db_refuses_an_unknown_revision(command: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/r.db"
    error = json_error(invoke("db", command, "nosuchrev", "--database-url", url), 2)
    assert error["code"] == "invalid_value" and error["field"] == "revision"
    assert "nosuchrev" in error["message"]


def test_db_uses_the_environment_url_and_names_it(tmp_path: Path) -> None:
    error = json_error(invoke("db", "current", env={"KVGATE_DATABASE_URL": "notaurl"}), 2)
    assert error["field"] == "KVGATE_DATABASE_URL"
    ok = invoke("db", "upgrade", env={"KVGATE_DATABASE_URL": f"sqlite:///{tmp_path}/ok.db"})
    assert ok.exit_code == 0, ok.output


def test_admin_refuses_an_unparsable_database_url() -> None:
    error = json_error(invoke("admin", "pools", "list", env={"KVGATE_DATABASE_URL": "notaurl"}), 2)
    assert error["code"] == "invalid_value" and error["field"] == "KVGATE_DATABASE_URL"


def test_admin_reports_an_unreachable_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/missing/dir/x.db"
    error = json_error(invoke("admin", "pools", "list", env={"KVGATE_DATABASE_URL": url}), 1)
    assert error["code"] == "database_unavailable"


@pytest.mark.parametrize("command", [["admin", "pools", "list"], ["db", "current"]])
def test_an_invalid_setting_is_named_by_its_variable(command: list[str]) -> None:
    error = json_error(invoke(*command, env={"KVGATE_PORT": "abc"}), 2)
    assert error["code"] == "invalid_value" and error["message"].startswith("KVGATE_PORT: ")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_serve_refuses_a_drain_timeout_that_is_not_finite_and_non_negative(value: str) -> None:
    line = one_line(invoke("serve", "--drain-timeout", value), 2)
    assert line.startswith("kvgate serve: refusing to start: --drain-timeout must be a finite number >= 0")


def test_engine_serve_refuses_a_port_in_use_before_loading_the_model() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = invoke("engine", "serve", "--port", str(port))
    line = one_line(result, 1)
    assert line.startswith(f"kvgate engine serve: cannot bind 127.0.0.1:{port}")
    assert "loading model" not in result.stdout


@pytest.mark.parametrize("kind", ["missing", "not GGUF"])
def test_engine_serve_reports_an_unloadable_gguf(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    if kind == "not GGUF":
        path.write_text('{"not": "a model"}\n')
    line = one_line(invoke("engine", "serve", "--port", "0", "--gguf", str(path)), 1)
    assert line.startswith("kvgate engine serve: ") and str(path) in line


@pytest.mark.parametrize("command", [["build", "repo", "reference-smollm2"], ["build", "engine", "reference-smollm2"],
                                     ["build", "engine", "reference-smollm2", "--dry-run"]])
def test_build_refuses_an_output_that_is_a_file(tmp_path: Path, command: list[str]) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = one_line(invoke(*command, "-o", str(a_file)), 2)
    assert line == f"error: --output {a_file} exists and is not a directory"


def test_build_repo_refuses_an_output_it_cannot_create() -> None:
    line = one_line(invoke("build", "repo", "reference-smollm2", "-o", "/proc/kvgate-repo"), 2)
    assert line.startswith("error: --output /proc/kvgate-repo cannot be created")


def test_engine_serve_refuses_a_port_out_of_range() -> None:
    result = invoke("engine", "serve", "--port", "70000")
    assert result.exit_code == 2 and "--port" in result.output and "65535" in result.output
    assert "loading model" not in result.output


@pytest.mark.parametrize(("url", "exit_code", "needle"), [
    ("notaurl", 2, "KVGATE_DATABASE_URL is not a database URL"),
    ("sqlite:///{tmp}/missing/dir/x.db", 1, "database error: OperationalError: unable to open database file"),
])
@pytest.mark.parametrize("flags", [[], ["--no-migrate", "--no-engine"]])
def test_serve_dev_reports_a_database_it_cannot_use(url: str, exit_code: int, needle: str, flags: list[str],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Migrations (and, without them, the demo seed) meet the database first: one line, no traceback."""
    monkeypatch.chdir(tmp_path)  # --dev writes its admin token file here
    result = invoke("serve", "--dev", *flags, env={"KVGATE_DATABASE_URL": url.format(tmp=tmp_path)})
    assert result.exit_code == exit_code and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]  # after the dev banner when seeding comes first
    assert last.startswith("kvgate serve: refusing to start: ") and needle in last, result.stderr
    if not flags:
        one_line(result, exit_code)  # migrations run before the banner


def test_serve_refuses_an_engine_port_out_of_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_line(invoke("serve", "--dev", "--engine-port", "70000",
                           env={"KVGATE_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"}), 2)
    assert line == "kvgate serve: refusing to start: --engine-port must be within [1, 65535], got 70000"
    assert not (tmp_path / "x.db").exists()  # refused before migrating


def _captures(tmp_path: Path, data: bytes) -> Path:
    pool = tmp_path / "traces" / "p"
    pool.mkdir(parents=True)
    (pool / "capture-000001-h-1.jsonl").write_bytes(data)
    return tmp_path / "traces"


LINE = b'{"timestamp": 100, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 4}\n'


def test_trace_export_names_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    traces = _captures(tmp_path, LINE + LINE.replace(b'"hash_ids"', b'"tenant": "\xff", "hash_ids"'))
    out = tmp_path / "out.jsonl"
    line = one_line(invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out)), 2)
    assert line == f"error: {traces / 'p' / 'capture-000001-h-1.jsonl'}: line 2: not valid UTF-8"
    assert not out.exists()


def test_trace_export_writes_nothing_when_nothing_matches(tmp_path: Path) -> None:
    traces, out = _captures(tmp_path, LINE), tmp_path / "out.jsonl"
    line = one_line(invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out), "--from", "500"), 2)
    assert line.startswith("error: no captured request in the time range") and "nothing written" in line
    assert not out.exists()


def test_trace_export_names_an_invalid_setting() -> None:
    error = json_error(invoke("trace", "export", "--pool", "p", "-o", "/tmp/never.jsonl",
                              env={"KVGATE_PORT": "abc"}), 2)
    assert error["code"] == "invalid_value" and error["message"].startswith("KVGATE_PORT: ")


@pytest.mark.parametrize(("command", "bad"), [
    (["plan", "{config}"], "config"), (["plan", "llama-3.1-8b", "--spec", "{spec}"], "spec"),
    (["build", "engine", "{spec}", "--dry-run", "-o", "{out}"], "spec"),
])
def test_a_config_or_spec_that_is_not_utf8_is_one_line(command: list[str], bad: str, tmp_path: Path) -> None:
    files = {"config": tmp_path / "config.json", "spec": tmp_path / "spec.yaml", "out": tmp_path / "out"}
    files["config"].write_bytes(b'{"model_type": "\xff"}\n')
    files["spec"].write_bytes(b'name: "\xff"\n')
    line = one_line(invoke(*(arg.format(**files) for arg in command)), 2)
    assert line.startswith(f"error: {files[bad]}: not UTF-8 (byte "), line


def test_admin_invalid_input_exits_2_and_a_registry_refusal_1(tmp_path: Path) -> None:
    env = {"KVGATE_DATABASE_URL": f"sqlite:///{tmp_path}/r.db", "KVGATE_KEY_PEPPER": "cli-test-pepper-0123456789abcdef"}
    assert invoke("db", "upgrade", env=env).exit_code == 0
    error = json_error(invoke("admin", "credentials", "create", "x", "--role", "tenant-admin", env=env), 2)
    assert (error["code"], error["field"]) == ("invalid_value", "tenants")
    assert json_error(invoke("admin", "tenants", "show", "nobody", env=env), 1)["code"].endswith("not_found")


def _line(ts: int, block_size: int) -> bytes:
    return b'{"timestamp": %d, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": %d}\n' % (
        ts, block_size)


def test_trace_export_names_where_one_captures_block_size_changes_and_the_time_ranges_to_export(
        tmp_path: Path) -> None:
    # The pool's engine rebuilt with another tokens_per_block at t=300 while capture 1 ran (two gateways).
    traces = _captures(tmp_path, _line(100, 16) + _line(200, 16) + _line(300, 32) + _line(400, 32))
    (traces / "p" / "capture-000001-g-2.jsonl").write_bytes(_line(150, 16) + _line(350, 32))
    out = tmp_path / "out.jsonl"
    line = one_line(invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out)), 2)
    assert line == (f"error: {traces / 'p' / 'capture-000001-h-1.jsonl'}: block_size changes from 16 to 32 within "
                    "capture 1, first at timestamp 300 ms (the pool's engine was rebuilt with another "
                    "tokens_per_block during the capture); export the two parts separately: --to 300, then --from 300")
    assert not out.exists()
    for bound, count in (("--to", 3), ("--from", 3)):  # the advice works
        res = invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out), bound, "300")
        assert res.exit_code == 0 and len(out.read_text().splitlines()) == count, res.output


def test_trace_export_of_captures_with_different_block_sizes_asks_for_one_capture(tmp_path: Path) -> None:
    traces = _captures(tmp_path, _line(100, 16))
    (traces / "p" / "capture-000002-h-1.jsonl").write_bytes(_line(500, 32))
    out = tmp_path / "out.jsonl"
    line = one_line(invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out)), 2)
    assert line == (f"error: {traces / 'p' / 'capture-000002-h-1.jsonl'}: block_size 32 (capture 2, first at "
                    f"timestamp 500 ms) differs from 16 in capture 1 ({traces / 'p' / 'capture-000001-h-1.jsonl'}); "
                    "export one capture (--capture ID)")
    assert "block size 32" in invoke("trace", "export", "--pool", "p", "--dir", str(traces), "-o", str(out),
                                     "--capture", "2").output
