"""`kvgate serve`: the gateway (OpenAI-compatible API), the admin API and, in dev mode,
the CPU reference engine and a demo tenant, in one command.

``--dev`` is the explicit development mode ``make serve`` uses: it migrates the database,
allows the built-in dev key pepper, creates (or reuses) a random admin token stored in
``.kvgate-dev-admin-token`` and announces all of that loudly. Without ``--dev`` the
service refuses placeholder secrets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import uvicorn

    from server.settings import Settings

BANNER = """
==========================================================================
  kvgate DEV MODE - not for production
  serving   : http://{host}:{port}/v1          (OpenAI-compatible)
  admin API : http://{host}:{port}/admin/v1   (docs: /admin/v1/docs)
  database  : {db}
  admin token ({origin}): {token}
  key pepper: {pepper}
  export KVGATE_ADMIN=$(cat {token_file})
==========================================================================
"""


DEMO = """
==========================================================================
  demo tenant 'demo' on pool 'reference' (model smollm2-135m-instruct)
  API key: {key}

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "smollm2-135m-instruct", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "import openai; c = openai.OpenAI(base_url='{base}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='smollm2-135m-instruct', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"
==========================================================================
"""


def register(app: typer.Typer) -> None:
    """Attach ``kvgate serve`` to the root CLI."""

    @app.command()
    def serve(
        host: Annotated[str | None, typer.Option(help="bind address (KVGATE_HOST, default 127.0.0.1)")] = None,
        port: Annotated[int | None, typer.Option(help="port (KVGATE_PORT, default 8000)")] = None,
        forwarded_allow_ips: Annotated[
            str | None,
            typer.Option(help="proxies whose X-Forwarded-Proto/-For are believed: comma-separated addresses or "
                              "networks, or '*' (KVGATE_FORWARDED_ALLOW_IPS, default this host only)"),
        ] = None,
        dev: Annotated[bool, typer.Option("--dev", help="development mode: dev token and pepper, loud banner")] = False,
        migrate: Annotated[
            bool | None, typer.Option("--migrate/--no-migrate", help="apply migrations first (default: on in --dev)")
        ] = None,
        engine: Annotated[
            bool | None,
            typer.Option("--engine/--no-engine", help="start the CPU reference engine as a child process (default: on in --dev)"),
        ] = None,
        engine_port: Annotated[int, typer.Option(help="gRPC port of the reference engine")] = 8001,
        seed_demo: Annotated[
            bool | None, typer.Option("--seed-demo/--no-seed-demo", help="create a demo pool/class/tenant/key (default: on in --dev)")
        ] = None,
        drain_timeout: Annotated[
            float, typer.Option(envvar="KVGATE_DRAIN_TIMEOUT", help="on SIGTERM: seconds to let in-flight requests finish (new ones get 503)")
        ] = 30.0,
    ) -> None:
        """Serve the gateway (/v1) and the admin API (/admin/v1)."""
        if not (math.isfinite(drain_timeout) and drain_timeout >= 0):
            typer.echo(f"kvgate serve: refusing to start: --drain-timeout must be a finite number >= 0, "
                       f"got {drain_timeout}", err=True)
            raise typer.Exit(2)
        if not 1 <= engine_port <= 65535:  # checked before migrations and the engine child, not by the child
            typer.echo(f"kvgate serve: refusing to start: --engine-port must be within [1, 65535], got {engine_port}",
                       err=True)
            raise typer.Exit(2)
        from pydantic import ValidationError

        from server.settings import DEV_TOKEN_FILE, Settings, SettingsError, settings_errors, with_dev_admin_token
        from tenants import migrate as migrations

        overrides: dict[str, object] = {}
        if host is not None:
            overrides["host"] = host
        if port is not None:
            overrides["port"] = port
        if forwarded_allow_ips is not None:
            overrides["forwarded_allow_ips"] = forwarded_allow_ips
        if dev:
            overrides["dev"] = True
        try:
            settings = Settings(**overrides)  # type: ignore[arg-type]
        except ValidationError as exc:
            message = settings_errors(exc)
            # A value given as an option is named as the option the user typed, not its variable.
            for field in overrides:
                message = message.replace(f"KVGATE_{field.upper()}:", f"--{field.replace('_', '-')}:")
            typer.echo(f"kvgate serve: refusing to start: {message}", err=True)
            raise typer.Exit(2) from None
        token_file = Path(DEV_TOKEN_FILE)
        settings, dev_token = with_dev_admin_token(settings, token_file=token_file)
        try:
            settings.check_serving_secrets()
        except SettingsError as exc:
            typer.echo(f"kvgate serve: refusing to start: {exc}", err=True)
            raise typer.Exit(2) from None
        migrating = migrate if migrate is not None else settings.dev
        seeding = seed_demo if seed_demo is not None else settings.dev
        if migrating or seeding:
            _check_database_url(settings.database_url)
        if migrating:
            with _database_unavailable():
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
        from server.demo import ReferencePoolShape
        from server.demo import seed_demo as seed
        from server.engine_process import EngineStartError, start_engine, stop_engine
        from server.serving import build_serving_app
        from tenants.db import make_engine, make_session_factory

        shape = ReferencePoolShape(port=engine_port)
        demo_key = None
        if seeding:
            with _database_unavailable():
                factory = make_session_factory(make_engine(settings.database_url))
                demo_key = seed(factory, pepper=settings.effective_key_pepper(), shape=shape)
        child = None
        if engine if engine is not None else settings.dev:
            try:
                child = start_engine(shape.engine_args(), port=engine_port, progress=lambda m: typer.echo(m, err=True))
            except EngineStartError as exc:
                typer.echo(f"kvgate serve: {exc}", err=True)
                raise typer.Exit(1) from None
        if demo_key:
            typer.secho(DEMO.format(base=f"http://{settings.host}:{settings.port}", key=demo_key),
                        fg=typer.colors.GREEN, err=True)
        try:
            from server.gateway.drain import DrainingServer

            app = build_serving_app(settings)
            DrainingServer(uvicorn_config(app, settings), app.state.gateway, drain_timeout=drain_timeout).run()
        finally:
            if child is not None:
                stop_engine(child)


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    """The uvicorn config `kvgate serve` runs ``app`` with.

    Behind a TLS-terminating proxy the scheme and client address come from its X-Forwarded-Proto /
    X-Forwarded-For, believed only from ``settings.forwarded_allow_ips`` (None: uvicorn's default,
    this host only): the console's cookie is ``Secure`` when that scheme is https.
    """
    import uvicorn

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          timeout_graceful_shutdown=30, proxy_headers=True,
                          forwarded_allow_ips=settings.forwarded_allow_ips)


def _check_database_url(url: str) -> None:
    """Exit 2 with one line when ``url`` cannot be parsed (before migrations or seeding use it)."""
    from sqlalchemy.exc import ArgumentError

    from tenants.db import make_engine

    try:
        make_engine(url).dispose()
    except (ArgumentError, ValueError) as exc:
        typer.echo(f"kvgate serve: refusing to start: KVGATE_DATABASE_URL is not a database URL ({exc})", err=True)
        raise typer.Exit(2) from None


@contextmanager
def _database_unavailable() -> Iterator[None]:
    """A database error (unreachable, refused, unwritable) exits 1 with one line, as ``kvgate db`` does."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        typer.echo(f"kvgate serve: refusing to start: database error: {type(orig).__name__}: "
                   f"{' '.join(str(orig).split())}", err=True)
        raise typer.Exit(1) from None
