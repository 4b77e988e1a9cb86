"""Alembic: upgrade to head and downgrade to base run clean, and the models have no drift."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from tenants import migrate
from tenants.db import make_engine
from tenants.models import Base
from tests.tenants.fixtures import PG_ADMIN_URL, drop_pg_schema, new_pg_schema, pg_engine, postgres_reachable

TABLES = {t.name for t in Base.metadata.sorted_tables}


def _round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) == TABLES | {"alembic_version"}
        assert migrate.current(connection=conn) == migrate.head()
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models and migrations drifted: {diff}"
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="base")
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
        assert migrate.current(connection=conn) is None
    # And back up again: downgrade left nothing behind that blocks a re-upgrade.
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) == TABLES | {"alembic_version"}


def test_sqlite_upgrade_downgrade_and_no_drift(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        _round_trip(engine)
    finally:
        engine.dispose()


def test_sqlite_by_url_like_the_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    migrate.upgrade(url=url)
    assert migrate.current(url=url) == migrate.head()
    migrate.downgrade(url=url, revision="base")
    assert migrate.current(url=url) is None


@pytest.mark.postgres
def test_postgres_upgrade_downgrade_and_no_drift() -> None:
    if not postgres_reachable():
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is unreachable")
    schema = new_pg_schema()
    engine = pg_engine(schema)
    try:
        _round_trip(engine)
    finally:
        engine.dispose()
        drop_pg_schema(schema)


def test_migration_files_ship_as_package_data() -> None:
    """Every file under tenants/migrations is covered by pyproject's package-data globs."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["tenants"]
    files = [
        p.relative_to(root / "tenants").as_posix()
        for p in (root / "tenants" / "migrations").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    assert any(f.startswith("migrations/versions/") for f in files)
    uncovered = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert uncovered == []


@pytest.mark.postgres
def test_postgres_by_url_like_the_cli() -> None:
    """The URL path of env.py (what ``kvgate db upgrade`` uses), with a %-escaped query string."""
    if not postgres_reachable():
        pytest.skip("PostgreSQL is unreachable")
    schema = new_pg_schema()
    url = f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    try:
        migrate.upgrade(url=url)
        assert migrate.current(url=url) == migrate.head()
        engine = pg_engine(schema)
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) == TABLES | {"alembic_version"}
        engine.dispose()
        migrate.downgrade(url=url, revision="base")
        assert migrate.current(url=url) is None
    finally:
        drop_pg_schema(schema)
