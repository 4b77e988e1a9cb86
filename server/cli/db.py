"""`kvgate db` commands: apply or roll back the registry's Alembic migrations."""

from __future__ import annotations

from typing import Annotated

import typer

UrlOption = Annotated[
    str | None,
    typer.Option("--database-url", help="overrides KVGATE_DATABASE_URL (default sqlite:///./kvgate.db)"),
]


def _url(database_url: str | None) -> str:
    from server.settings import Settings

    return database_url or Settings().database_url


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
        migrate.downgrade(url=url, revision=revision)
        typer.echo(f"database at revision {migrate.current(url=url) or 'base'}")

    @db.command()
    def current(database_url: UrlOption = None) -> None:
        """Print the database's revision and the code's head."""
        from tenants import migrate

        typer.echo(f"current: {migrate.current(url=_url(database_url)) or 'base'}  head: {migrate.head()}")
