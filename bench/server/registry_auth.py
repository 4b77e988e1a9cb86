"""Tenant-registry hot path: API-key authentication and admin writes, SQLite and PostgreSQL.

Usage: ``.venv/bin/python bench/server/registry_auth.py [--tenants 200] [--lookups 3000] [--no-write]``

Builds a fresh registry (a temporary SQLite file in WAL mode; a fresh PostgreSQL schema
when 127.0.0.1:5432 is reachable) with ``--tenants`` tenants, one key each, then measures:

* ``authenticate_key``: one call = parse, one indexed query (key by prefix joined with
  tenant, pool, class), one HMAC-SHA256 and ``compare_digest`` — the gateway's cache miss;
* ``authenticate_key`` with a wrong secret (must cost about the same);
* ``create_tenant``: one admin write with its audit event, committed.

Medians and p99 per call are printed and written into the ``bench:registry`` section of
docs/benchmarks.md (only that section is replaced).
"""

from __future__ import annotations

import argparse
import platform
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import seed_line, write_section  # noqa: E402

from sqlalchemy import text  # noqa: E402

from tenants import authenticate_key, migrate  # noqa: E402
from tenants.db import make_engine, make_session_factory  # noqa: E402
from tenants.keys import create_key  # noqa: E402
from tenants.pools import create_pool  # noqa: E402
from tenants.retention_classes import create_class  # noqa: E402
from tenants.tenant import create_tenant  # noqa: E402

SECTION = "registry"
PEPPER = "bench-pepper-0123456789abcdef0123"
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def run(factory, *, tenants: int, lookups: int) -> dict[str, tuple[float, float]]:  # type: ignore[no-untyped-def]
    now = datetime.now(UTC)
    plaintexts: list[str] = []
    writes: list[float] = []
    with factory() as s:
        create_pool(s, actor="bench", now=now, name="p", model_name="m",
                    replicas=[{"name": "r0", "endpoint": "h:1"}], primary_blocks=1024)
        create_class(s, actor="bench", now=now, name="c")
        for i in range(tenants):
            start = time.perf_counter()
            create_tenant(s, actor="bench", now=now, slug=f"t{i}", display_name=f"T{i}", pool="p", retention_class="c")
            writes.append(time.perf_counter() - start)
            plaintexts.append(create_key(s, actor="bench", now=now, tenant=f"t{i}", pepper=PEPPER)[1])
    good: list[float] = []
    bad: list[float] = []
    with factory() as s:
        for i in range(lookups):
            key = plaintexts[i % len(plaintexts)]
            wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
            start = time.perf_counter()
            hit = authenticate_key(s, plaintext=key, pepper=PEPPER, now=now)
            good.append(time.perf_counter() - start)
            start = time.perf_counter()
            miss = authenticate_key(s, plaintext=wrong, pepper=PEPPER, now=now)
            bad.append(time.perf_counter() - start)
            assert hit is not None and miss is None
            s.rollback()  # end the read transaction, as a fresh gateway session would
    return {
        "authenticate_key (valid)": _percentiles(good),
        "authenticate_key (wrong secret)": _percentiles(bad),
        "create_tenant (+audit, commit)": _percentiles(writes),
    }


def sqlite_run(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        migrate.upgrade(url=url)
        engine = make_engine(url)
        try:
            return run(make_session_factory(engine), tenants=args.tenants, lookups=args.lookups)
        finally:
            engine.dispose()


def postgres_run(args: argparse.Namespace) -> dict[str, tuple[float, float]] | None:
    admin = make_engine(PG_URL, connect_args={"connect_timeout": 2})
    schema = f"kvgate_bench_{secrets.token_hex(4)}"
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:  # noqa: BLE001 - no server: report and skip
        print(f"postgres: skipped ({type(exc).__name__})")
        return None
    engine = make_engine(PG_URL, connect_args={"options": f"-csearch_path={schema}"})
    try:
        with engine.begin() as conn:
            migrate.upgrade(connection=conn)
        return run(make_session_factory(engine), tenants=args.tenants, lookups=args.lookups)
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--lookups", type=int, default=3000)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = {"SQLite (file, WAL)": sqlite_run(args)}
    pg = postgres_run(args)
    if pg is not None:
        results["PostgreSQL 127.0.0.1"] = pg
    lines = [
        "## Tenant registry (`bench/server/registry_auth.py`)",
        "",
        seed_line(None, "keys and schema names come from `secrets`; no figure depends on their values"),
        "",
        f"{args.tenants} tenants with one key each; {args.lookups} lookups per case; one session, one thread. "
        f"Machine: {platform.machine()}, Python {platform.python_version()}, run {datetime.now(UTC):%Y-%m-%d}. "
        "Shared CI-class machine: treat as orders of magnitude.",
        "",
        "| backend | operation | median µs | p99 µs |",
        "|---|---|---:|---:|",
    ]
    for backend, rows in results.items():
        for op, (median, p99) in rows.items():
            lines.append(f"| {backend} | {op} | {median * 1e6:,.0f} | {p99 * 1e6:,.0f} |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
