"""A real kvgate stack for end-to-end tests: reference engine process + gateway over HTTP.

Nothing is faked: the engine is ``kvgate engine serve`` in a child process (so tests can
kill and restart it), the gateway is the app ``kvgate serve`` builds, served by uvicorn
on a loopback port, and the registry is a migrated SQLite file.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn

from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory

ACTOR = "test:stack"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EngineProcess:
    port: int
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:  # a shared 2-core machine can take minutes to load the model
        import tritonclient.grpc as grpcclient

        log = open(self.log_path, "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", KVGATE_ENGINE_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "engine", "serve", "--port", str(self.port), *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if client.is_model_ready("kvgate_llm"):
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not ready after {timeout}s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class GatewayServer:
    app: object
    port: int
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    asgi: object | None = None  # what uvicorn serves, when not ``app`` itself (a test wrapper around it)
    drain_timeout: float | None = None  # set: served as ``kvgate serve`` does, by its DrainingServer

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = uvicorn.Config(self.asgi or self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        if self.drain_timeout is None:
            self.server = uvicorn.Server(config)
        else:
            from server.gateway.drain import DrainingServer

            self.server = DrainingServer(config, self.app.state.gateway, drain_timeout=self.drain_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(30)


@dataclass
class Stack:
    engine: EngineProcess
    gateway: GatewayServer
    session_factory: object
    admin_token: str
    tokens_per_block: int
    keys: dict[str, str] = field(default_factory=dict)
    trace_dir: Path | None = None  # live trace captures (server/gateway/observe/capture.py) write here
    settings: Settings | None = None  # the gateway's (a test may start a second gateway on the same registry)

    def now(self) -> datetime:
        return datetime.now(UTC)

    def add_tenant(self, slug: str, *, retention_class: str = "standard", pool: str = "reference", **overrides) -> str:
        """Create a tenant and return a fresh API key's plaintext."""
        with self.session_factory() as session:
            tenant.create_tenant(session, actor=ACTOR, now=self.now(), slug=slug, display_name=slug.title(),
                                 pool=pool, retention_class=retention_class, **overrides)
        with self.session_factory() as session:
            created = keys.create_key(session, actor=ACTOR, now=self.now(), tenant=slug, pepper=PEPPER, name="test")
        plaintext = created[1] if isinstance(created, tuple) else created.plaintext
        self.keys[slug] = plaintext
        return plaintext


PEPPER = "test-pepper-" + secrets.token_hex(16)


def build_stack(tmp: Path, *, engine_args: list[str], tokens_per_block: int, primary: int, secondary: int,
                offload_min_priority: int = 30, engine_timeout: float = 120.0, settings: dict | None = None) -> Stack:
    engine = EngineProcess(free_port(), engine_args, tmp / "engine.log")
    engine.start(timeout=engine_timeout)
    url = f"sqlite:///{tmp / 'registry.db'}"
    migrate.upgrade(url=url)
    db_engine = make_engine(url)
    factory = make_session_factory(db_engine)
    admin_token = "admin-" + secrets.token_hex(16)
    now = datetime.now(UTC)
    with factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name="reference", model_name=MODEL,
                          triton_url=f"127.0.0.1:{engine.port}", engine_spec="reference-smollm2",
                          tokens_per_block=tokens_per_block, primary_blocks=primary, secondary_blocks=secondary,
                          secondary_offload_min_priority=offload_min_priority)
    with factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=now, name="standard",
                                       system_priority=90, context_priority=60, turn_priority=40,
                                       decode_priority=20)
    app_settings = Settings(database_url=url, admin_tokens=[f"ci:{admin_token}"], key_pepper=PEPPER, dev=False,
                            **{"trace_dir": tmp / "traces", "usage_journal_dir": tmp / "usage-journal",
                               **(settings or {})})
    app = build_serving_app(app_settings, session_factory=factory, auth_ttl=0.5,
                            intervals=LoopIntervals(usage_flush=0.5, last_used_flush=1.0, pool_poll=0.3,
                                                    capture_refresh=0.3))
    gateway = GatewayServer(app, free_port())
    gateway.start()
    return Stack(engine, gateway, factory, admin_token, tokens_per_block, trace_dir=tmp / "traces",
                 settings=app_settings)
