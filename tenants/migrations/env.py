"""Alembic environment for the tenant registry.

URL precedence: an open connection handed over in ``config.attributes["connection"]``
(tests, ``kvgate db`` with an engine), then ``sqlalchemy.url`` set by
``tenants.migrate``, then ``server.settings``-style ``KVGATE_DATABASE_URL`` / the
default SQLite file. ``compare_type=True`` so autogenerate notices type changes;
SQLite gets batch mode because it cannot ALTER most things in place.
"""

from __future__ import annotations

import os

from alembic import context

from tenants.db import DEFAULT_DATABASE_URL, make_engine
from tenants.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    # Read the environment here rather than import server.settings: tenants/ never imports upward.
    return config.get_main_option("sqlalchemy.url") or os.environ.get("KVGATE_DATABASE_URL", DEFAULT_DATABASE_URL)


def _configure(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, compare_type=True, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
