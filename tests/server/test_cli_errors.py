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
