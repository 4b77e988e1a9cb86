"""``kvgate`` command line. Each sub-module owns one command family and registers it.

Heavy imports (torch, the model, FastAPI) happen inside command functions, so
``kvgate --help`` stays fast.
"""

from __future__ import annotations

import typer

from server.cli import admin, analyze, build, db, engine, plan, serve, simulate, trace


def create_cli() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvgate: multi-tenant KV-cache-aware LLM serving.")
    @app.callback()
    def root() -> None:
        """kvgate: multi-tenant KV-cache-aware LLM serving on TensorRT-LLM and Triton."""

    for module in (db, admin, serve, simulate, analyze, trace, plan, engine, build):
        module.register(app)

    @app.command()
    def version() -> None:
        """Print the kvgate version."""
        from importlib.metadata import version as dist_version

        typer.echo(dist_version("kvgate"))

    return app


def main() -> None:
    create_cli()()
