"""Alembic: upgrade to head and downgrade to base run clean, and the models have no drift."""

from __future__ import annotations

import fnmatch
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from tenants import migrate
from tenants.db import make_engine, make_session_factory
from tenants.models import Base, UtcDateTime
from tenants.usage import UsageRow, record_usage, usage_report
from tests.tenants.fixtures import PG_ADMIN_URL, drop_pg_schema, new_pg_schema, pg_engine, postgres_reachable

TABLES = {t.name for t in Base.metadata.sorted_tables}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def migration_engine(request, tmp_path: Path):  # type: ignore[no-untyped-def]
    """An empty database for one migration test: a SQLite file, or a fresh PostgreSQL schema
    (dropped afterwards; skipped when PostgreSQL is unreachable)."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'migrations.db'}")
        yield engine
        engine.dispose()
        return
    if not postgres_reachable():
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is unreachable")
    schema = new_pg_schema()
    engine = pg_engine(schema)
    yield engine
    engine.dispose()
    drop_pg_schema(schema)


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


# --- 0003: pools.triton_url <-> pool_replicas, with data ---------------------------------------

_T = "2026-11-30 12:00:00+00:00"


def _seed_0002(conn) -> None:  # type: ignore[no-untyped-def]
    """Two pools in the 0002 schema (one with a tenant), written as plain SQL."""
    for pid, name, url in ((1, "gpu-a", "engine-a:8001"), (2, "gpu-b", "10.0.0.7:9001")):
        conn.execute(text(
            "INSERT INTO pools (id, name, model_name, triton_url, triton_model, engine_spec, tokens_per_block, "
            "primary_blocks, secondary_blocks, secondary_offload_min_priority, created_at, updated_at, version) "
            f"VALUES ({pid}, '{name}', 'm', '{url}', 'kvgate_llm', '', 32, 64, 0, 35, '{_T}', '{_T}', 3)"
        ))
    conn.execute(text(
        "INSERT INTO retention_classes (id, name, description, system_priority, context_priority, turn_priority, "
        f"decode_priority, mode, created_at, updated_at, version) VALUES (1, 'gold', '', 90, 60, 35, 35, 'static', "
        f"'{_T}', '{_T}', 1)"
    ))
    conn.execute(text(
        "INSERT INTO tenants (id, slug, display_name, status, pool_id, retention_class_id, isolation, cache_salt, "
        "rpm_limit, tpm_limit, max_concurrent_requests, max_prompt_tokens, max_output_tokens, kv_quota_fraction, "
        f"created_at, updated_at, version) VALUES (1, 'acme', 'Acme', 'active', 1, 1, 'salted', 'salt', 1, 1, 1, 1, 1, "
        f"0.5, '{_T}', '{_T}', 1)"
    ))


def _replicas_and_pools_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0003")
    with engine.connect() as conn:
        assert "triton_url" not in {c["name"] for c in inspect(conn).get_columns("pools")}
        rows = conn.execute(text(
            "SELECT pool_id, name, endpoint, state, weight, version FROM pool_replicas ORDER BY id"
        )).all()
        assert [tuple(r) for r in rows] == [
            (1, "r0", "engine-a:8001", "active", 1, 1),
            (2, "r0", "10.0.0.7:9001", "active", 1, 1),
        ]
        # The tenant still points at its pool, the pool kept its version.
        assert conn.execute(text("SELECT pool_id FROM tenants")).scalar_one() == 1
        assert conn.execute(text("SELECT version FROM pools WHERE id = 1")).scalar_one() == 3
    with engine.begin() as conn:
        # A second replica on gpu-a, and gpu-b's first replica disabled: the downgrade keeps
        # each pool's first replica by id, whatever its state.
        conn.execute(text(
            "INSERT INTO pool_replicas (pool_id, name, endpoint, state, weight, created_at, updated_at, version) "
            f"VALUES (1, 'r1', 'engine-a2:8001', 'active', 2, '{_T}', '{_T}', 1)"
        ))
        conn.execute(text("UPDATE pool_replicas SET state = 'disabled' WHERE pool_id = 2"))
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0002")
    with engine.connect() as conn:
        assert "pool_replicas" not in inspect(conn).get_table_names()
        urls = conn.execute(text("SELECT id, triton_url FROM pools ORDER BY id")).all()
        assert [tuple(r) for r in urls] == [(1, "engine-a:8001"), (2, "10.0.0.7:9001")]
        nullable = {c["name"]: c["nullable"] for c in inspect(conn).get_columns("pools")}
        assert nullable["triton_url"] is False
    with engine.begin() as conn:  # and up again with the restored column
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT pool_id, name, endpoint FROM pool_replicas ORDER BY id")).all()
        assert [tuple(r) for r in rows] == [(1, "r0", "engine-a:8001"), (2, "r0", "10.0.0.7:9001")]


def test_0003_moves_triton_url_into_replicas_and_back(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _replicas_and_pools_round_trip(migration_engine)


# --- 0004: pool_slo_budgets, with data -----------------------------------------------------------


def _slo_budgets_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0004")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO pool_slo_budgets (pool_id, ttft_p99_ms, itl_p99_ms, window_seconds, min_requests, "
            "cooldown_seconds, hysteresis, enabled, pilot_fraction, created_at, updated_at, version) "
            f"VALUES (1, 800, NULL, 60, 20, 300, 0.2, TRUE, 1.0, '{_T}', '{_T}', 1)"
        ))
    with engine.connect() as conn:  # the database itself refuses a second budget for a pool
        with pytest.raises(Exception), conn.begin():
            conn.execute(text(
                "INSERT INTO pool_slo_budgets (pool_id, window_seconds, min_requests, cooldown_seconds, hysteresis, "
                f"enabled, pilot_fraction, created_at, updated_at, version) VALUES (1, 60, 20, 300, 0.2, TRUE, 1.0, "
                f"'{_T}', '{_T}', 1)"
            ))
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0003")
    with engine.connect() as conn:
        assert "pool_slo_budgets" not in inspect(conn).get_table_names()
        assert conn.execute(text("SELECT count(*) FROM pools")).scalar_one() == 2  # pools untouched
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pool_slo_budgets")).scalar_one() == 0  # no guard armed


def test_0004_slo_budgets_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _slo_budgets_round_trip(migration_engine)


# --- 0006: retention class hint fields, with data ------------------------------------------------


def _hint_fields_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0006")
    with engine.connect() as conn:  # the existing class ignores hints until an operator enables them
        row = conn.execute(text("SELECT hints_enabled, hint_max_ttl_ms, hint_max_priority, hint_quota_fraction "
                                "FROM retention_classes WHERE id = 1")).one()
        assert (bool(row[0]), row[1], row[2], row[3]) == (False, 3_600_000, 60, 0.5)
        for bad in ("hint_max_priority = 101", "hint_quota_fraction = 0", "hint_max_ttl_ms = 0"):
            with pytest.raises(Exception), conn.begin():  # the database itself refuses it
                conn.execute(text(f"UPDATE retention_classes SET {bad} WHERE id = 1"))
    with engine.begin() as conn:
        conn.execute(text("UPDATE retention_classes SET hints_enabled = TRUE, hint_max_priority = 70 WHERE id = 1"))
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0005")
    with engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("retention_classes")}
        assert not {c for c in columns if c.startswith("hint")}
        assert conn.execute(text("SELECT name FROM retention_classes")).scalar_one() == "gold"
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT hint_max_priority FROM retention_classes")).scalar_one() == 60


def test_0006_hint_fields_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _hint_fields_round_trip(migration_engine)


# --- 0007: stored_responses, with data ----------------------------------------------------------


def _stored_responses_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0007")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO stored_responses (id, tenant_id, previous_response_id, model, input_items, output_items, "
            f"body, size_bytes, created_at, expires_at) VALUES ('resp_1', 1, NULL, 'm', '[]', '[]', '{{}}', 6, "
            f"'{_T}', '{_T}')"
        ))
    with engine.connect() as conn:  # the database itself refuses a negative size and an unknown tenant
        for values in ("'resp_2', 1, NULL, 'm', '[]', '[]', '{}', -1", "'resp_3', 99, NULL, 'm', '[]', '[]', '{}', 1"):
            with pytest.raises(Exception), conn.begin():
                conn.execute(text(
                    "INSERT INTO stored_responses (id, tenant_id, previous_response_id, model, input_items, "
                    f"output_items, body, size_bytes, created_at, expires_at) VALUES ({values}, '{_T}', '{_T}')"
                ))
    with engine.begin() as conn:  # a deleted tenant takes its stored responses with it
        conn.execute(text("DELETE FROM tenants WHERE id = 1"))
        assert conn.execute(text("SELECT count(*) FROM stored_responses")).scalar_one() == 0
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0006")
    with engine.connect() as conn:
        assert "stored_responses" not in inspect(conn).get_table_names()
        assert conn.execute(text("SELECT count(*) FROM pools")).scalar_one() == 2  # pools untouched
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM stored_responses")).scalar_one() == 0


def test_0007_stored_responses_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _stored_responses_round_trip(migration_engine)


# --- 0009: the conversation hold switch; stored responses' root and prompt blocks, with data ------


def _conversation_hold_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0008")
        conn.execute(text("UPDATE retention_classes SET hints_enabled = TRUE WHERE id = 1"))
        conn.execute(text(
            "INSERT INTO stored_responses (id, tenant_id, previous_response_id, model, input_items, output_items, "
            f"body, size_bytes, created_at, expires_at) VALUES ('resp_1', 1, NULL, 'm', '[]', '[]', '{{}}', 6, "
            f"'{_T}', '{_T}')"))
        migrate.upgrade(connection=conn, revision="0009")
    with engine.connect() as conn:  # a class with hints on holds no conversation until an operator says so
        assert not conn.execute(text("SELECT conversation_hold_enabled FROM retention_classes")).scalar_one()
        assert tuple(conn.execute(text("SELECT root_id, prompt_blocks FROM stored_responses")).one()) == (None, None)
        assert "ix_stored_responses_tenant_root" in {i["name"] for i in inspect(conn).get_indexes("stored_responses")}
    with engine.begin() as conn:
        conn.execute(text("UPDATE retention_classes SET conversation_hold_enabled = TRUE WHERE id = 1"))
        conn.execute(text("UPDATE stored_responses SET root_id = 'resp_1', prompt_blocks = '[18446744073709551615]'"))
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0008")
    with engine.connect() as conn:
        assert "conversation_hold_enabled" not in {c["name"] for c in inspect(conn).get_columns("retention_classes")}
        assert not {"root_id", "prompt_blocks"} & {c["name"] for c in inspect(conn).get_columns("stored_responses")}
        assert conn.execute(text("SELECT id FROM stored_responses")).scalar_one() == "resp_1"  # the row stays
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert not conn.execute(text("SELECT conversation_hold_enabled FROM retention_classes")).scalar_one()


def test_0009_conversation_hold_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _conversation_hold_round_trip(migration_engine)


# --- 0010: the run's-end demote switch, with data -------------------------------------------------


def _end_demote_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0009")
        conn.execute(text("UPDATE retention_classes SET conversation_hold_enabled = TRUE WHERE id = 1"))
        migrate.upgrade(connection=conn, revision="0010")
    with engine.connect() as conn:  # a class with the hold on sends no end demote until an operator says so
        row = conn.execute(text("SELECT conversation_hold_enabled, conversation_end_demote_enabled "
                                "FROM retention_classes WHERE id = 1")).one()
        assert (bool(row[0]), bool(row[1])) == (True, False)
    with engine.begin() as conn:  # and the new column takes its default on an insert that leaves it out
        conn.execute(text(
            "INSERT INTO retention_classes (id, name, description, system_priority, context_priority, turn_priority, "
            f"decode_priority, mode, created_at, updated_at, version) VALUES (2, 'silver', '', 10, 10, 10, 10, "
            f"'static', '{_T}', '{_T}', 1)"))
        conn.execute(text("UPDATE retention_classes SET conversation_end_demote_enabled = TRUE WHERE id = 1"))
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, conversation_end_demote_enabled FROM retention_classes ORDER BY id"))
        assert [(n, bool(e)) for n, e in rows] == [("gold", True), ("silver", False)]
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0009")
    with engine.connect() as conn:
        assert "conversation_end_demote_enabled" not in {
            c["name"] for c in inspect(conn).get_columns("retention_classes")}
        row = conn.execute(text("SELECT name, conversation_hold_enabled FROM retention_classes WHERE id = 1")).one()
        assert (row[0], bool(row[1])) == ("gold", True)  # the row and the hold's switch stay
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert not any(e for (e,) in conn.execute(text("SELECT conversation_end_demote_enabled FROM retention_classes")))


def test_0010_end_demote_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _end_demote_round_trip(migration_engine)


# --- 0011: SQLite ids never reused (AUTOINCREMENT), with data -------------------------------------

_NEVER_REUSED = ("retention_classes", "pools", "pool_replicas", "tenants", "api_keys", "admin_credentials",
                 "trace_captures")


def _seed_0010(conn) -> None:  # type: ignore[no-untyped-def]
    """On top of _seed_0002 at 0010: a second tenant (deleted, newest), keys, usage, a stored
    response, a scoped credential, a capture, and the audit events the services would have written."""
    conn.execute(text(
        "INSERT INTO tenants (id, slug, display_name, status, pool_id, retention_class_id, isolation, cache_salt, "
        "rpm_limit, tpm_limit, max_concurrent_requests, max_prompt_tokens, max_output_tokens, kv_quota_fraction, "
        f"created_at, updated_at, version) VALUES (2, 'bravo', 'Bravo', 'active', 1, 1, 'salted', 'salt2', 1, 1, 1, "
        f"1, 1, 0.5, '{_T}', '{_T}', 1)"))
    for key_id, tenant_id in ((1, 1), (2, 2)):
        conn.execute(text(
            "INSERT INTO api_keys (id, tenant_id, prefix, secret_hash, name, created_at) "
            f"VALUES ({key_id}, {tenant_id}, 'prefix0{key_id}', 'h', '', '{_T}')"))
    conn.execute(text("INSERT INTO usage (tenant_id, minute, requests, prompt_tokens, completion_tokens) "
                      f"VALUES (1, '{_T}', 3, 30, 300)"))
    conn.execute(text(
        "INSERT INTO stored_responses (id, tenant_id, previous_response_id, model, input_items, output_items, "
        f"body, size_bytes, created_at, expires_at) VALUES ('resp_1', 1, NULL, 'm', '[]', '[]', '{{}}', 6, "
        f"'{_T}', '{_T}')"))
    conn.execute(text(
        "INSERT INTO admin_credentials (id, name, role, scoped, prefix, secret_hash, created_by, created_at) "
        f"VALUES (1, 'acme-admin', 'tenant-admin', TRUE, 'credpfx1', 'h', 'test', '{_T}')"))
    conn.execute(text("INSERT INTO admin_credential_tenants (credential_id, tenant_id) VALUES (1, 1)"))
    conn.execute(text(
        "INSERT INTO trace_captures (id, pool_id, tenant_id, sample_rate, max_bytes, state, key, started_at, "
        f"created_at, updated_at, version) VALUES (1, 1, 1, 1.0, 100, 'active', 'k', '{_T}', '{_T}', '{_T}', 1)"))
    events = [("tenant.create", "tenant", 1), ("tenant.create", "tenant", 2), ("api_key.create", "api_key", 1),
              ("api_key.create", "api_key", 2), ("tenant.delete", "tenant", 2)]
    for action, entity_type, entity_id in events:
        conn.execute(text("INSERT INTO audit_events (at, actor, action, entity_type, entity_id) "
                          f"VALUES ('{_T}', 'test', '{action}', '{entity_type}', '{entity_id}')"))
    conn.execute(text("DELETE FROM tenants WHERE id = 2"))  # the newest tenant goes, its key with it


def _contents(conn) -> dict[str, list[tuple]]:  # type: ignore[no-untyped-def]
    queries = {
        "pools": "SELECT id, name, version FROM pools ORDER BY id",
        "pool_replicas": "SELECT id, pool_id, name FROM pool_replicas ORDER BY id",
        "retention_classes": "SELECT id, name FROM retention_classes ORDER BY id",
        "tenants": "SELECT id, slug, pool_id FROM tenants ORDER BY id",
        "api_keys": "SELECT id, tenant_id, prefix FROM api_keys ORDER BY id",
        "usage": "SELECT tenant_id, requests, prompt_tokens FROM usage",
        "stored_responses": "SELECT id, tenant_id FROM stored_responses",
        "admin_credentials": "SELECT id, name FROM admin_credentials",
        "admin_credential_tenants": "SELECT credential_id, tenant_id FROM admin_credential_tenants",
        "trace_captures": "SELECT id, pool_id, tenant_id FROM trace_captures",
        "audit_events": "SELECT count(*) FROM audit_events",
    }
    return {name: [tuple(r) for r in conn.execute(text(sql))] for name, sql in queries.items()}


def _new_tenant(conn, slug: str) -> int:  # type: ignore[no-untyped-def]
    return conn.execute(text(
        "INSERT INTO tenants (slug, display_name, status, pool_id, retention_class_id, isolation, cache_salt, "
        "rpm_limit, tpm_limit, max_concurrent_requests, max_prompt_tokens, max_output_tokens, kv_quota_fraction, "
        f"created_at, updated_at, version) VALUES ('{slug}', 'X', 'active', 1, 1, 'salted', 's', 1, 1, 1, 1, 1, 0.5, "
        f"'{_T}', '{_T}', 1) RETURNING id")).scalar_one()


def _sqlite_table_sql(conn, table: str) -> str:  # type: ignore[no-untyped-def]
    return conn.execute(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"), {"t": table}).scalar_one()


def _seeded_at_0010(engine) -> dict:  # type: ignore[no-untyped-def]
    """Migrate an empty database to 0010 with rows seeded on the way (ids with gaps); its contents."""
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0010")
        _seed_0010(conn)
    with engine.connect() as conn:
        return _contents(conn)


def test_sqlite_0011_ids_are_never_reused_and_the_data_stays(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'm11.db'}")
    try:
        before = _seeded_at_0010(engine)
        assert before["tenants"] == [(1, "acme", 1)] and before["api_keys"] == [(1, 1, "prefix01")]
        with engine.begin() as conn:
            migrate.upgrade(connection=conn, revision="0011")
        with engine.connect() as conn:
            # Every row and id stays; no child row went with a rebuilt parent (foreign keys were off).
            assert _contents(conn) == before
            assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1  # and are on again
            assert conn.execute(text("PRAGMA foreign_key_check")).all() == []
            for table in _NEVER_REUSED:
                assert "AUTOINCREMENT" in _sqlite_table_sql(conn, table), table
            # Column CHECKs stay column CHECKs (the 0002/0006 downgrades drop those columns natively).
            assert "mode VARCHAR(16) DEFAULT 'static' NOT NULL CONSTRAINT ck_retention_classes_mode_enum" in \
                _sqlite_table_sql(conn, "retention_classes")
        with engine.begin() as conn:
            # Tenant 2 was deleted before the upgrade, but its audit events name it: not handed out again.
            assert _new_tenant(conn, "charlie") == 3
            conn.execute(text("DELETE FROM tenants WHERE id = 3"))  # the newest goes ...
            assert _new_tenant(conn, "delta") == 4  # ... and its id is not reused either
            assert conn.execute(text(
                "INSERT INTO api_keys (tenant_id, prefix, secret_hash, name, created_at) "
                f"VALUES (1, 'prefix03', 'h', '', '{_T}') RETURNING id")).scalar_one() == 3
        with engine.connect() as conn:  # the constraints still hold
            for bad in ("UPDATE tenants SET kv_quota_fraction = 2 WHERE id = 1",
                        "UPDATE tenants SET pool_id = 99 WHERE id = 1",
                        "DELETE FROM pools WHERE id = 1",  # RESTRICT: tenants are on it
                        "INSERT INTO trace_captures (pool_id, sample_rate, max_bytes, state, key, started_at, created_at,"
                        f" updated_at, version) VALUES (1, 1.0, 1, 'active', 'k', '{_T}', '{_T}', '{_T}', 1)"):
                with pytest.raises(Exception), conn.begin():
                    conn.execute(text(bad))
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM tenants WHERE id = 4"))
            after = _contents(conn)
        with engine.begin() as conn:
            migrate.downgrade(connection=conn, revision="0010")
        with engine.connect() as conn:
            assert _contents(conn) == after
            for table in _NEVER_REUSED:
                assert "AUTOINCREMENT" not in _sqlite_table_sql(conn, table), table
                assert f"CONSTRAINT pk_{table} PRIMARY KEY (id)" in _sqlite_table_sql(conn, table), table
        with engine.begin() as conn:  # down to where the 0002/0006 native DROP COLUMNs run, and up again
            migrate.downgrade(connection=conn, revision="0001")
            migrate.upgrade(connection=conn)
        with engine.connect() as conn:
            assert [tuple(r) for r in conn.execute(text("SELECT id, slug FROM tenants ORDER BY id"))] == [(1, "acme")]
            assert "AUTOINCREMENT" in _sqlite_table_sql(conn, "tenants")
    finally:
        engine.dispose()


@pytest.mark.parametrize("migration_engine", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_postgres_0011_changes_nothing(migration_engine) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL sequences never hand out an id twice: 0011 is a no-op there, both ways."""
    engine = migration_engine
    before = _seeded_at_0010(engine)
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0011")
    with engine.connect() as conn:
        assert _contents(conn) == before
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0010")
    with engine.connect() as conn:
        assert _contents(conn) == before


# --- 0012: cache token counters in the usage ledger, with data -----------------------------------

_CACHE = "cache_read_tokens, cache_write_5m_tokens, cache_write_1h_tokens"
# the usage table as a gateway before 0012 wrote it (its minutes bound as the model binds them)
_OLD_USAGE = sa.table("usage", sa.column("tenant_id"), sa.column("minute", UtcDateTime()), sa.column("requests"),
                      sa.column("prompt_tokens"), sa.column("completion_tokens"))
_MINUTE = datetime(2026, 12, 1, tzinfo=UTC)  # after the seeded tenant's creation (_T)


def _usage_cache_round_trip(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        migrate.upgrade(connection=conn, revision="0002")
        _seed_0002(conn)
        migrate.upgrade(connection=conn, revision="0011")
        conn.execute(_OLD_USAGE.insert().values(tenant_id=1, minute=_MINUTE, requests=3, prompt_tokens=300,
                                                completion_tokens=30))
        migrate.upgrade(connection=conn, revision="0012")
    with engine.connect() as conn:  # the minutes counted before read 0
        assert tuple(conn.execute(text(f"SELECT requests, {_CACHE} FROM usage")).one()) == (3, 0, 0, 0)
        columns = {c["name"]: c for c in inspect(conn).get_columns("usage")}
        assert all(columns[n]["nullable"] is False for n in _CACHE.split(", "))
    with engine.begin() as conn:  # an older gateway's insert names only the old columns: 0 again
        conn.execute(_OLD_USAGE.insert().values(tenant_id=1, minute=_MINUTE + timedelta(minutes=1), requests=1,
                                                prompt_tokens=10, completion_tokens=1))
    factory = make_session_factory(engine)
    with factory() as session:  # this version's ledger on the migrated table: adds to the old minute
        at = _MINUTE + timedelta(seconds=30)
        assert record_usage(session, flush_id="after-0012", rows=[UsageRow(1, at, 1, 100, 10, 48, 32, 16)])
        totals, page = usage_report(session, tenant="acme")
        assert (totals.requests, totals.prompt_tokens, totals.cache_read_tokens, totals.cache_write_5m_tokens,
                totals.cache_write_1h_tokens) == (5, 410, 48, 32, 16)
        assert [(u.requests, u.cache_read_tokens, u.cache_write_1h_tokens) for u in page.items] == [(4, 48, 16),
                                                                                                      (1, 0, 0)]
    with engine.begin() as conn:
        migrate.downgrade(connection=conn, revision="0011")
    with engine.connect() as conn:  # the columns go, the minutes stay
        assert not {c["name"] for c in inspect(conn).get_columns("usage")} & set(_CACHE.split(", "))
        assert conn.execute(text("SELECT sum(requests) FROM usage")).scalar_one() == 5
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    with engine.connect() as conn:
        assert [tuple(r) for r in conn.execute(text(f"SELECT {_CACHE} FROM usage"))] == [(0, 0, 0)] * 2


def test_0012_usage_cache_tokens_up_and_down(migration_engine) -> None:  # type: ignore[no-untyped-def]
    _usage_cache_round_trip(migration_engine)
