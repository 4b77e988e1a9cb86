"""The CLI's shared option types and helpers: what every registry command family uses.

Option types (``Annotated`` aliases typer reads), the ``--set field=value`` parser, a
registry session that turns registry and validation errors into the admin error shape on
stderr (exit 2: invalid input, what the admin API answers 422; exit 1: the registry's state
refuses it: not found, forbidden, conflict, stale version, in use; ``admin apply --exit-code``
adds exit 3: the plan has changes), and the audit actor ``cli:<os user>``.
Command modules (``admin``, ``slo``, ``trace``) import from here and never from each other.
"""

from __future__ import annotations

import getpass
import importlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer


class CliError(ValueError):
    """Invalid command-line input; the command prints it and exits with code 2."""


Sets = Annotated[list[str] | None, typer.Option("--set", help="field=value (value parsed as JSON, else a string)")]
Limit = Annotated[int, typer.Option(help="page size 1..500")]
Offset = Annotated[int, typer.Option(help="rows to skip")]
PoolArg = Annotated[str, typer.Argument(metavar="POOL", help="pool id or name")]
ReplicaName = Annotated[str, typer.Argument(metavar="NAME", help="replica name")]
OptVersion = Annotated[int | None, typer.Option(help="optional: fail unless this is the current version")]


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            fail(2, "invalid_value", f"--set expects field=value, got {item!r}", "--set")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


class Lazy:
    """A module imported on first attribute access (keeps ``kvgate --help`` fast)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(self._path), name)


def validate_body(schema: Any, **values: Any) -> Any:
    """Validate CLI input exactly as the API validates a JSON request body."""
    return schema.model_validate_json(json.dumps(values))


def fail(exit_code: int, code: str, message: str, field: str | None = None) -> None:
    typer.echo(json.dumps({"error": {"code": code, "message": message, "field": field}}), err=True)
    raise typer.Exit(exit_code)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def writable_dir(directory: Path) -> bool:
    """Whether a file can be created in ``directory``: a real write, since access bits say nothing
    to root or in /proc."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def output_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be, or be created as, a directory to write in (None: it can), checked
    before a command's work so that it fails at once, not after it."""
    if path.exists() and not path.is_dir():
        return "exists and is not a directory"
    existing = path
    while not existing.exists():  # the nearest existing ancestor will hold the new directories
        existing = existing.parent
    if not existing.is_dir() or not writable_dir(existing):
        return f"cannot be created ({existing} is not a writable directory)"
    return None


def load_settings() -> Any:
    """``Settings()`` from the environment; an invalid ``KVGATE_*`` variable exits 2 with one line."""
    from pydantic import ValidationError

    from server.settings import Settings, settings_errors

    try:
        return Settings()
    except ValidationError as exc:
        fail(2, "invalid_value", settings_errors(exc), "settings")


def database_engine(url: str, field: str = "KVGATE_DATABASE_URL") -> Any:
    """An engine for ``url``; a URL that cannot be parsed exits 2 naming ``field``."""
    from sqlalchemy.exc import ArgumentError

    from tenants.db import make_engine

    try:
        return make_engine(url)
    except (ArgumentError, ValueError) as exc:
        fail(2, "invalid_value", f"{field}: not a database URL ({exc})", field)


def database_error(exc: Exception) -> None:
    """Exit 1 with the ``database_unavailable`` error for a SQLAlchemy error."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    # A missing table (SQLite "no such table", PostgreSQL UndefinedTable) means the schema was never created.
    unmigrated = "no such table" in text or type(orig).__name__ == "UndefinedTable"
    hint = "; the database has no registry schema yet: run `kvgate db upgrade`" if unmigrated else ""
    fail(1, "database_unavailable", f"database error: {type(orig).__name__}: {text}{hint}")


@contextmanager
def registry_session() -> Iterator[Any]:
    """A registry session from settings; registry/validation errors become CLI errors (invalid
    values exit 2, as the API's 422; other registry errors exit 1)."""
    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError

    from tenants.db import make_session_factory
    from tenants.errors import RegistryError

    engine = database_engine(load_settings().database_url)
    try:
        with make_session_factory(engine)() as session:
            yield session
    except RegistryError as exc:
        fail(2 if exc.kind == "invalid" else 1, exc.code, exc.message, exc.field)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        fail(2, "invalid_value", f"{field}: {first['msg']}", field)
    except SQLAlchemyError as exc:
        database_error(exc)
    finally:
        engine.dispose()


def cli_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user database entry in some containers
        return "cli:unknown"


def utc_now() -> datetime:
    return datetime.now(UTC)


def page_of(schema: Any, result: Any, convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    items = [convert(r) if convert else schema.model_validate(r).model_dump(mode="json") for r in result.items]
    return {"items": items, "total": result.total, "limit": result.limit, "offset": result.offset}
