"""Run the registry's Alembic migrations programmatically (no alembic.ini needed).

The migration scripts live in ``tenants/migrations`` and ship as package data. Pass
either a URL or an open ``Connection`` (tests pass one bound to a fresh schema).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection

from tenants.db import normalize_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(*, url: str | None = None, connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        # ConfigParser interpolation: a literal % in a password must be doubled.
        cfg.set_main_option(
            "sqlalchemy.url", normalize_url(url).render_as_string(hide_password=False).replace("%", "%%")
        )
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(*, url: str | None = None, connection: Connection | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(url=url, connection=connection), revision)


def downgrade(*, url: str | None = None, connection: Connection | None = None, revision: str = "base") -> None:
    command.downgrade(alembic_config(url=url, connection=connection), revision)


def current(*, url: str | None = None, connection: Connection | None = None) -> str | None:
    """The database's current revision (None = not migrated)."""
    from alembic.runtime.migration import MigrationContext

    from tenants.db import make_engine

    if connection is not None:
        return MigrationContext.configure(connection).get_current_revision()
    assert url is not None
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    from alembic.script import ScriptDirectory

    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert rev is not None
    return rev
