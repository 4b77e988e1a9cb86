"""`kvgate serve`: run the HTTP service (the admin API for now) under uvicorn.

``--dev`` is the explicit development mode ``make serve`` uses: it migrates the database,
allows the built-in dev key pepper, creates (or reuses) a random admin token stored in
``.kvgate-dev-admin-token`` and announces all of that loudly. Without ``--dev`` the
service refuses placeholder secrets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

BANNER = """
==========================================================================
  kvgate DEV MODE - not for production
  admin API : http://{host}:{port}/admin/v1   (docs: /admin/v1/docs)
  database  : {db}
  admin token ({origin}): {token}
  key pepper: {pepper}
  export KVGATE_ADMIN=$(cat {token_file})
==========================================================================
"""


def register(app: typer.Typer) -> None:
    """Attach ``kvgate serve`` to the root CLI."""

    @app.command()
    def serve(
        host: Annotated[str | None, typer.Option(help="bind address (KVGATE_HOST, default 127.0.0.1)")] = None,
        port: Annotated[int | None, typer.Option(help="port (KVGATE_PORT, default 8000)")] = None,
        dev: Annotated[bool, typer.Option("--dev", help="development mode: dev token and pepper, loud banner")] = False,
        migrate: Annotated[
            bool | None, typer.Option("--migrate/--no-migrate", help="apply migrations first (default: on in --dev)")
        ] = None,
    ) -> None:
        """Serve the kvgate HTTP API (admin API at /admin/v1)."""
        import uvicorn

        from server.app import create_app
        from server.settings import DEV_TOKEN_FILE, Settings, SettingsError, with_dev_admin_token
        from tenants import migrate as migrations

        overrides: dict[str, object] = {}
        if host is not None:
            overrides["host"] = host
        if port is not None:
            overrides["port"] = port
        if dev:
            overrides["dev"] = True
        settings = Settings(**overrides)  # type: ignore[arg-type]
        token_file = Path(DEV_TOKEN_FILE)
        settings, dev_token = with_dev_admin_token(settings, token_file=token_file)
        try:
            settings.check_serving_secrets()
        except SettingsError as exc:
            typer.echo(f"kvgate serve: refusing to start: {exc}", err=True)
            raise typer.Exit(2) from None
        if migrate if migrate is not None else settings.dev:
            migrations.upgrade(url=settings.database_url)
        if settings.dev:
            typer.secho(
                BANNER.format(
                    host=settings.host,
                    port=settings.port,
                    db=settings.database_url,
                    origin=f"from {token_file}" if dev_token else "from KVGATE_ADMIN_TOKENS",
                    token=dev_token or "<as configured>",
                    pepper="KVGATE_KEY_PEPPER" if settings.key_pepper else "built-in DEV pepper (keys are not secure)",
                    token_file=token_file,
                ),
                fg=typer.colors.YELLOW,
                bold=True,
                err=True,
            )
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
