"""Processes and registries the reliability suite (and ``bench/reliability/load.py``) runs against.

Everything here is real: the gateway is ``kvgate serve`` in a child process (so a test
can SIGTERM or SIGKILL it, or read its RSS), the engine is ``kvgate engine serve`` (the
stack's :class:`EngineProcess`), the database is SQLite or a throw-away PostgreSQL
database. The proxies that watch engine and database traffic are in ``proxies.py``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import make_url, text

from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tests.server.gateway.stack import MODEL, free_port

ROOT = Path(__file__).resolve().parents[2]
ACTOR = "test:reliability"
PG_ADMIN_URL = os.environ.get("KVGATE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


# Registry ------------------------------------------------------------------------------------
@dataclass
class Registry:
    """A migrated registry with one pool and one retention class, and helpers to add tenants."""

    url: str
    pepper: str
    factory: object = None

    def __post_init__(self) -> None:
        migrate.upgrade(url=self.url)
        self.factory = make_session_factory(make_engine(self.url))

    def now(self) -> datetime:
        return datetime.now(UTC)

    def add_pool(self, name: str, triton_url: str, *, tokens_per_block: int = 16, primary: int = 512,
                 secondary: int = 512, offload_min_priority: int = 30) -> None:
        with self.factory() as session:
            pools.create_pool(session, actor=ACTOR, now=self.now(), name=name, model_name=MODEL, triton_url=triton_url,
                              engine_spec="reference-smollm2", tokens_per_block=tokens_per_block,
                              primary_blocks=primary, secondary_blocks=secondary,
                              secondary_offload_min_priority=offload_min_priority)

    def add_class(self, name: str = "standard") -> None:
        with self.factory() as session:
            retention_classes.create_class(session, actor=ACTOR, now=self.now(), name=name, system_priority=90,
                                           context_priority=60, turn_priority=40, decode_priority=20)

    def add_tenant(self, slug: str, *, pool: str, retention_class: str = "standard", **fields) -> str:
        """Create a tenant; return a fresh API key's plaintext."""
        with self.factory() as session:
            tenant.create_tenant(session, actor=ACTOR, now=self.now(), slug=slug, display_name=slug.title(),
                                 pool=pool, retention_class=retention_class, **fields)
        return self.add_key(slug)

    def add_key(self, slug: str) -> str:
        with self.factory() as session:
            return keys.create_key(session, actor=ACTOR, now=self.now(), tenant=slug, pepper=self.pepper, name="rel")[1]

    def revoke_all_keys(self, slug: str) -> None:
        listed, offset = [], 0
        while True:
            with self.factory() as session:
                page = keys.list_keys(session, tenant=slug, limit=500, offset=offset)
            listed += page.items
            offset += len(page.items)
            if not page.items or offset >= page.total:
                break
        for key in listed:
            with self.factory() as session:
                keys.revoke_key(session, actor=ACTOR, now=self.now(), tenant=slug, key_id=key.id)


@dataclass
class PostgresDatabase:
    """A fresh PostgreSQL database (not just a schema: a child process must reach it by URL alone)."""

    name: str = field(default_factory=lambda: "kvgate_rel_" + secrets.token_hex(5))

    @property
    def url(self) -> str:
        return str(make_url(PG_ADMIN_URL).set(database=self.name).render_as_string(hide_password=False))

    def url_via(self, port: int) -> str:
        return str(make_url(self.url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False))

    def create(self) -> PostgresDatabase:
        admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        admin.dispose()
        return self

    def drop(self) -> None:
        admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        admin.dispose()


def postgres_port() -> int:
    return make_url(PG_ADMIN_URL).port or 5432


# Gateway process -----------------------------------------------------------------------------
@dataclass
class GatewayProcess:
    """``kvgate serve --no-engine`` in a child process, configured by environment only."""

    database_url: str
    pepper: str
    workdir: Path
    admin_token: str = field(default_factory=lambda: "rel-admin-" + secrets.token_hex(16))
    port: int = field(default_factory=free_port)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", KVGATE_DATABASE_URL=self.database_url,
                   KVGATE_KEY_PEPPER=self.pepper, KVGATE_ADMIN_TOKENS=f"rel:{self.admin_token}",
                   KVGATE_LOG_LEVEL="warning", PYTHONPATH=str(ROOT), **self.extra_env)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"gateway-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo", "--no-migrate",
             "--port", str(self.port)], env=env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.workdir}")
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("gateway did not start")

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """Wait until /readyz says ready (tokenizers warm, engine reachable)."""
        deadline = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < deadline:
            response = httpx.get(self.base_url + "/readyz", timeout=5)
            body = response.json()
            if response.status_code == 200:
                return body
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready: {body}")

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
