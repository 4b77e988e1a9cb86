"""Pieces the reliability suite (and ``bench/load.py``) runs real processes with.

Everything here is real: the gateway is ``kvgate serve`` in a child process (so a test
can SIGTERM or SIGKILL it), the engine is ``kvgate engine serve`` (the stack's
:class:`EngineProcess`), the database is SQLite or a throw-away PostgreSQL database,
and the two proxies forward real traffic:

* :class:`CountingProxy` sits between gateway and engine (KServe v2 gRPC) and counts,
  per ``tenant_id`` tensor, the requests the engine is working on, so concurrency
  limits are checked where they matter: at the engine;
* :class:`TcpCut` forwards TCP to PostgreSQL and can be cut (every connection reset,
  new ones refused) and restored, which is what a database outage looks like to us.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import httpx
from sqlalchemy import make_url, text
from tritonclient.grpc import service_pb2_grpc

from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tests.server.gateway.recording_proxy import RecordingProxy
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


# Engine-side counting proxy ------------------------------------------------------------------
def _tenant_of(request) -> str | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "tenant_id" and index < len(request.raw_input_contents):
            raw = request.raw_input_contents[index]
            size = int.from_bytes(raw[:4], "little")  # KServe BYTES: 4-byte length, then the bytes
            return raw[4:4 + size].decode()
    return None


def _ints(raw: bytes) -> tuple[int, ...]:
    return tuple(array("i", raw))


def _input_ids(request) -> tuple[int, ...] | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "input_ids" and index < len(request.raw_input_contents):
            return _ints(request.raw_input_contents[index])
    return None


def _output_ids(response) -> tuple[int, ...]:
    infer = response.infer_response
    for index, tensor in enumerate(infer.outputs):
        if tensor.name == "output_ids" and index < len(infer.raw_output_contents):
            return _ints(infer.raw_output_contents[index])
    return ()


@dataclass
class EngineCall:
    """One generation request as the engine saw it: who, which prompt, which tokens came back."""

    tenant_id: str
    input_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    final: bool = False


def _is_final(response) -> bool:
    param = response.infer_response.parameters.get("triton_final_response")
    return bool(param.bool_param) if param is not None else True


class CountingProxy(RecordingProxy):
    """Forwards to the engine and tracks, per tenant id, generation requests in progress.

    A request counts from its arrival at the proxy until the proxy forwards its final
    response (or the call ends): the gateway releases a tenant's concurrency lease only
    after it has read that final response, so a correct gateway never makes the count
    exceed the tenant's limit, with no race in the measurement itself.
    """

    def __init__(self, upstream: str, *, record: bool = False) -> None:
        super().__init__(upstream)
        self._record = record
        self.in_flight: dict[str, int] = defaultdict(int)
        self.max_in_flight: dict[str, int] = defaultdict(int)
        self.started: dict[str, int] = defaultdict(int)
        self.finished: dict[str, int] = defaultdict(int)
        self.responses: dict[str, int] = defaultdict(int)
        self.calls: list[EngineCall] = []  # every generation call, in arrival order

    async def ModelStreamInfer(self, request_iterator, context):
        tenants: list[str] = []
        open_: set[str] = set()
        calls: list[EngineCall] = []

        async def forward():
            async for request in request_iterator:
                if self._record:
                    self.requests.append(request)
                tenant_id = _tenant_of(request)
                if tenant_id is not None:
                    tenants.append(tenant_id)
                    self.started[tenant_id] += 1
                    self.in_flight[tenant_id] += 1
                    self.max_in_flight[tenant_id] = max(self.max_in_flight[tenant_id], self.in_flight[tenant_id])
                    open_.add(tenant_id)
                    call = EngineCall(tenant_id, _input_ids(request) or ())
                    calls.append(call)
                    self.calls.append(call)
                yield request

        def close(tenant_id: str) -> None:
            if tenant_id in open_:
                open_.discard(tenant_id)
                self.in_flight[tenant_id] -= 1
                self.finished[tenant_id] += 1

        try:
            async for response in self._stub.ModelStreamInfer(forward()):
                if tenants:
                    self.responses[tenants[-1]] += 1
                    calls[-1].output_ids.extend(_output_ids(response))
                    if _is_final(response):
                        calls[-1].final = True
                        close(tenants[-1])
                yield response
        finally:
            for tenant_id in list(open_):
                close(tenant_id)


async def start_counting_proxy(upstream: str, *, port: int = 0) -> tuple[grpc.aio.Server, CountingProxy, int]:
    proxy = CountingProxy(upstream)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(proxy, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, proxy, bound


def run_counting_proxy_in_thread(upstream: str) -> tuple[CountingProxy, int, callable]:
    """The proxy on its own event loop thread (for tests whose clients are synchronous)."""
    import asyncio

    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server, proxy, port = loop.run_until_complete(start_counting_proxy(upstream))
        started.update(server=server, proxy=proxy, port=port)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(started["server"].stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return started["proxy"], started["port"], stop


# Cuttable TCP proxy --------------------------------------------------------------------------
class TcpCut:
    """TCP forwarder to ``upstream_port`` on loopback; :meth:`cut` makes the upstream vanish."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> TcpCut:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Refuse new connections and reset every open one (a database that went away)."""
        # Why shutdown before close: close() alone does not wake a thread blocked in
        # accept()/recv() on Linux, and the socket would keep working.
        if self._listener is not None:
            _hard_close(self._listener)
            self._listener = None
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            _hard_close(s, reset=True)

    def restore(self) -> None:
        self.start()

    def close(self) -> None:
        self.cut()


def _hard_close(sock: socket.socket, *, reset: bool = False) -> None:
    try:
        if reset:  # linger 0: the peer sees a reset, as when a server dies
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
