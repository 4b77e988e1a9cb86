"""`kvgate db` commands: apply or roll back the registry's Alembic migrations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from server.cli.options import database_engine, database_error, fail, load_settings

UrlOption = Annotated[
    str | None,
    typer.Option("--database-url", help="overrides KVGATE_DATABASE_URL (default sqlite:///./kvgate.db)"),
]


def _url(database_url: str | None) -> str:
    """The URL to migrate; one that cannot be parsed exits 2 naming where it came from."""
    url = database_url or load_settings().database_url
    database_engine(url, "--database-url" if database_url else "KVGATE_DATABASE_URL").dispose()
    return url


@contextmanager
def _db_errors() -> Iterator[None]:
    """Database and Alembic errors become one ``database_unavailable`` / ``invalid_value`` line."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        database_error(exc)
    except CommandError as exc:
        fail(2, "invalid_value", f"revision: {exc}", "revision")


def register(app: typer.Typer) -> None:
    """Attach ``kvgate db upgrade|downgrade|current`` to the root CLI."""
    db = typer.Typer(no_args_is_help=True, help="Registry database migrations (Alembic).")
    app.add_typer(db, name="db")

    @db.command()
    def upgrade(
        revision: Annotated[str, typer.Argument(help="target revision")] = "head",
        database_url: UrlOption = None,
    ) -> None:
        """Upgrade the registry schema (default: to head)."""
        from tenants import migrate

        url = _url(database_url)
        with _db_errors():
            migrate.upgrade(url=url, revision=revision)
            typer.echo(f"database at revision {migrate.current(url=url)}")

    @db.command()
    def downgrade(
        revision: Annotated[
            str, typer.Argument(help="target revision: 'base' drops everything; use '-- -1' for one step")
        ],
        database_url: UrlOption = None,
    ) -> None:
        """Downgrade the registry schema to REVISION (explicit, because it drops data)."""
        from tenants import migrate

        url = _url(database_url)
        with _db_errors():
            migrate.downgrade(url=url, revision=revision)
            typer.echo(f"database at revision {migrate.current(url=url) or 'base'}")

    @db.command()
    def current(database_url: UrlOption = None) -> None:
        """Print the database's revision and the code's head."""
        from tenants import migrate

        url = _url(database_url)
        with _db_errors():
            typer.echo(f"current: {migrate.current(url=url) or 'base'}  head: {migrate.head()}")
