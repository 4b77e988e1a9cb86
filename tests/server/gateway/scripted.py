"""A gateway in front of scripted replicas: the harness of the tests of failures mid-answer.

The replicas are a KServe v2 double (:class:`ScriptedReplicas`: the real ``kvgate_llm``
contract, decoded with the engines' own code) whose calls can be held, stalled or aborted,
and which counts the calls it started, finished and saw cancelled. The gateway is the app
``kvgate serve`` builds, over HTTP, on a migrated SQLite registry (or any session factory).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import httpx
import numpy as np
from sqlalchemy import func, select
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engines.contract import KvMetrics, is_stats_request, parse_request
from engines.pool_stats import PoolStatsReport, TierStats
from engines.reference.kserve import decode_inputs, encode_outputs
from engines.response_tensors import KV_CACHE_STATS, encode_response
from engines.tokenizer import load_gguf_tokenizer
from server.gateway.replicas.breaker import Breaker
from server.gateway.replicas.routing import RoutingConfig
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tenants.models import Tenant, Usage
from tests.server.gateway.stack import GatewayServer, free_port

ACTOR = "test:scripted"
MODEL = "smollm2-135m-instruct"
POOL = "scripted"
TPB = 16
PEPPER = "scripted-pepper-" + secrets.token_hex(16)


@functools.cache
def tokenizer():
    return load_gguf_tokenizer()


# The replicas -------------------------------------------------------------------------------
@dataclass
class Faults:
    """What the next generation calls (on any replica) do; ``calls`` of them (None: all)."""

    hold: bool = False  # no message at all until cancelled (streamed or not)
    stall_after: int | None = None  # streamed: after this many tokens, nothing more until cancelled
    die_after: int | None = None  # streamed: after this many tokens, the call is aborted (UNAVAILABLE)
    calls: int | None = None


@dataclass
class Counts:
    started: int = 0
    active: int = 0
    cancelled: int = 0
    completed: int = 0


class _Replica(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, owner: ScriptedReplicas, name: str) -> None:
        self.owner = owner
        self.name = name
        self.counts = Counts()

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    @staticmethod
    def _stats(request) -> service_pb2.ModelInferResponse:
        report = PoolStatsReport(TPB, TierStats(1024, 1024, 0), TierStats(0, 0, 0))
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        encode_outputs(response, {KV_CACHE_STATS.name: np.array([report.to_json().encode()], np.object_)})
        return response

    async def ModelInfer(self, request, context):
        return self._stats(request)

    @staticmethod
    def _message(request, tokens: list[int], generated: int, final: bool) -> service_pb2.ModelStreamInferResponse:
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        encode_outputs(response, encode_response(tokens, generated, KvMetrics(0, 1, 1, 0)))
        response.parameters["triton_final_response"].bool_param = final
        return service_pb2.ModelStreamInferResponse(infer_response=response)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            tensors = decode_inputs(request)
            if is_stats_request(tensors):
                yield service_pb2.ModelStreamInferResponse(infer_response=self._stats(request))
                continue
            parsed = parse_request(tensors, max_output_len=4096, max_input_len=1 << 20, vocab_size=49152)
            faults = self.owner.take()
            n = min(parsed.max_new_tokens, self.owner.tokens)
            word = self.owner.word
            counts = self.counts
            counts.started += 1
            counts.active += 1
            try:
                if faults.hold:
                    await asyncio.sleep(3600)
                if not parsed.streaming:
                    yield self._message(request, [word] * n, n, True)
                else:
                    for i in range(n):
                        if faults.stall_after is not None and i >= faults.stall_after:
                            await asyncio.sleep(3600)
                        if faults.die_after is not None and i >= faults.die_after:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died")
                        await asyncio.sleep(self.owner.token_delay_s)
                        yield self._message(request, [word], i + 1, i == n - 1)
                counts.completed += 1
            except asyncio.CancelledError:
                counts.cancelled += 1
                raise
            finally:
                counts.active -= 1


class ScriptedReplicas:
    """Replicas ``r0``, ``r1``, … on loopback ports, served from one event loop thread."""

    def __init__(self, count: int = 2, *, tokens: int = 8, token_delay_s: float = 0.02) -> None:
        self.tokens = tokens
        self.token_delay_s = token_delay_s
        self.word = tokenizer().encode(" hello")[0]
        self._faults = Faults(calls=0)
        self._lock = threading.Lock()
        self.replicas = {f"r{i}": _Replica(self, f"r{i}") for i in range(count)}
        self.ports = {name: free_port() for name in self.replicas}
        self._loop = asyncio.new_event_loop()
        self._servers: list[grpc.aio.Server] = []
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)

            async def serve() -> None:
                for name, servicer in self.replicas.items():
                    server = grpc.aio.server()
                    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
                    server.add_insecure_port(f"127.0.0.1:{self.ports[name]}")
                    await server.start()
                    self._servers.append(server)
                started.set()

            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(30), "replicas did not start"

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def fault(self, **faults) -> None:
        """The next generation calls' faults (``calls``: how many; default all)."""
        with self._lock:
            self._faults = Faults(**faults)

    def heal(self) -> None:
        self.fault(calls=0)

    def take(self) -> Faults:
        with self._lock:
            faults = self._faults
            if faults.calls is None:
                return faults
            if faults.calls <= 0:
                return Faults()
            faults.calls -= 1
            return faults

    def counts(self, name: str) -> Counts:
        return self.replicas[name].counts

    def total(self, what: str) -> int:
        return sum(getattr(r.counts, what) for r in self.replicas.values())

    def stop(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                await server.stop(None)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# The gateway --------------------------------------------------------------------------------
@dataclass
class Gateway:
    server: GatewayServer
    factory: object
    replicas: ScriptedReplicas
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def services(self):
        return self.server.app.state.gateway

    def add_tenant(self, slug: str, **limits: int) -> str:
        now = datetime.now(UTC)
        with self.factory() as session:
            tenant.create_tenant(session, actor=ACTOR, now=now, slug=slug, display_name=slug, pool=POOL,
                                 retention_class="chat", **limits)
        with self.factory() as session:
            created = keys.create_key(session, actor=ACTOR, now=now, tenant=slug, pepper=PEPPER, name="t")
        self.keys[slug] = created[1] if isinstance(created, tuple) else created.plaintext
        return self.keys[slug]

    def headers(self, slug: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[slug]}"}

    @staticmethod
    def body(*, stream: bool = False, max_tokens: int = 8, **extra) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream, **extra}

    def chat(self, slug: str, *, timeout: float = 60.0, **body) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=self.body(**body), headers=self.headers(slug),
                          timeout=timeout)

    def breaker(self, name: str) -> Breaker:
        route = self.services.routing.pools[POOL]
        return next(r.breaker for r in route.replicas.values() if r.name == name)

    def reset_breakers(self) -> None:
        route = self.services.routing.pools.get(POOL)
        for replica in route.replicas.values() if route is not None else ():
            replica.breaker = Breaker()

    def admitted(self, slug: str) -> int:
        return asyncio.run(self.services.admission.in_flight(slug))

    def usage(self, slug: str) -> tuple[int, int]:
        """(requests, completion tokens) the registry holds for ``slug``."""
        with self.factory() as session:
            row = session.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                         func.coalesce(func.sum(Usage.completion_tokens), 0))
                                  .join(Tenant, Tenant.id == Usage.tenant_id).where(Tenant.slug == slug)).one()
        return int(row[0]), int(row[1])

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        self.server.stop()
        self.replicas.stop()


def start_gateway(tmp: Path, replicas: ScriptedReplicas, *, factory=None, routing: RoutingConfig | None = None,
                  settings: dict | None = None, auth_ttl: float = 0.3, drain_timeout: float | None = None) -> Gateway:
    """A gateway on a registry holding one pool whose replicas are ``replicas``; ``factory``: the
    registry's session factory (None: a migrated SQLite file under ``tmp``)."""
    url = f"sqlite:///{tmp / 'registry.db'}"
    if factory is None:
        migrate.upgrade(url=url)
        factory = make_session_factory(make_engine(url))
    now = datetime.now(UTC)
    with factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name=POOL, model_name=MODEL, engine_spec="reference-smollm2",
                          tokens_per_block=TPB, primary_blocks=1024, secondary_blocks=0,
                          replicas=[{"name": name, "endpoint": replicas.endpoint(name)} for name in replicas.replicas])
    with factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=now, name="chat", system_priority=90,
                                       context_priority=60, turn_priority=40, decode_priority=20)
    app_settings = Settings(database_url=url, admin_tokens=[f"ci:admin-{secrets.token_hex(8)}"], key_pepper=PEPPER,
                            trace_dir=tmp / "traces", usage_journal_dir=tmp / "journal", **(settings or {}))
    app = build_serving_app(app_settings, session_factory=factory, tokenizer_for=lambda pool: tokenizer(),
                            auth_ttl=auth_ttl, routing=routing,
                            intervals=LoopIntervals(usage_flush=0.3, last_used_flush=1.0, pool_poll=0.2))
    server = GatewayServer(app, free_port(), drain_timeout=drain_timeout)
    server.start()
    return Gateway(server, factory, replicas)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached")
        time.sleep(0.02)


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


class TextTokenizer:
    """What ``CompletionRunner`` reads of a tokenizer, for a runner driven without a model: every token
    decodes to "x"; the end token is 2."""

    eos_token_id = 2

    def new_decode_stream(self):  # type: ignore[no-untyped-def]
        return self

    def push(self, token_id: int) -> str:
        return "x"
