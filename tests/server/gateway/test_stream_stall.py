"""A replica that fails or goes silent in the middle of an answer.

Streamed: once the first token went out the replica is final, so a replica that stops
sending must not keep the stream open forever. The inter-token deadline cancels the call
on the engine, counts a timeout in the replica's breaker, and ends the stream with the
dialect's error event. Non-streamed with stop strings (the engine streams, the client gets
the answer whole): nothing reached the client, so the answer is run again on another
replica, and only the answer the client got is billed; with no replica left it is a 504
(silent) or a 503 (died) in the API's error shape, and not billed.

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
import pytest
from sqlalchemy import func, select
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engines.contract import (KV_CACHE_STATS, EngineRequest, KvMetrics, SamplingParams, encode_response,
                              is_stats_request, parse_request)
from engines.pool_stats import PoolStatsReport, TierStats
from engines.reference.kserve import decode_inputs, encode_outputs
from engines.tokenizer import load_gguf_tokenizer
from retention.types import RetentionPlan
from server.gateway.replicas.breaker import Breaker
from server.gateway.replicas.engine_client import EngineChunk
from server.gateway.replicas.routing import Routing, RoutingConfig
from server.gateway.replicas.stall import EngineStalled
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tenants.models import Tenant, Usage
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
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
                  settings: dict | None = None, auth_ttl: float = 0.3) -> Gateway:
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
    server = GatewayServer(app, free_port())
    server.start()
    return Gateway(server, factory, replicas)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached")
        time.sleep(0.02)


# The tests ----------------------------------------------------------------------------------
STALL_S = 1.0  # the inter-token deadline here: far above a healthy gap (20 ms), short for a test


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    routing = RoutingConfig(router="round-robin", first_token_timeout_s=10.0, inter_token_timeout_s=STALL_S)
    built = start_gateway(tmp_path_factory.mktemp("stall"), ScriptedReplicas(2), routing=routing)
    built.add_tenant("st")
    yield built
    built.close()


@pytest.fixture(autouse=True)
def healthy(gateway):
    """Every test starts with healthy replicas, both in rotation, and nothing in flight."""
    gateway.replicas.heal()
    gateway.reset_breakers()
    yield
    gateway.replicas.heal()
    wait_until(lambda: gateway.replicas.total("active") == 0, what="engines idle")
    gateway.reset_breakers()


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_the_default_inter_token_deadline_is_the_first_token_deadline():
    assert RoutingConfig(first_token_timeout_s=12.0).stall_wait() == 12.0
    assert RoutingConfig(first_token_timeout_s=12.0, inter_token_timeout_s=3.0).stall_wait() == 3.0
    assert RoutingConfig(first_token_timeout_s=12.0, inter_token_timeout_s=0.0).stall_wait() is None
    assert RoutingConfig(first_token_timeout_s=0.0).stall_wait() is None
    assert Settings(dev=True).inter_token_timeout_s is None


def test_a_stream_whose_replica_goes_silent_ends_with_an_error_event_and_the_call_cancelled(gateway):
    replicas = gateway.replicas
    replicas.fault(stall_after=2)  # every call: two tokens, then silence
    cancelled = replicas.total("cancelled")
    errors = gateway.metric("kvgate_replica_requests_total", status="error")
    requests_before, tokens_before = gateway.usage("st")
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=gateway.body(stream=True, max_tokens=8),
                      headers=gateway.headers("st"), timeout=httpx.Timeout(30, read=15)) as response:
        assert response.status_code == 200
        replica = response.headers["x-kvgate-replica"]
        text = response.read().decode()
    elapsed = time.monotonic() - started
    assert elapsed < STALL_S + 5, elapsed  # ended by the deadline, not by the client
    events = sse_events(text)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert content == " hello hello"  # what came before the silence
    error = events[-1]["error"]
    assert error["code"] == "engine_timeout" and error["type"] == "timeout_error"
    assert "mid-answer" in error["message"]
    assert "data: [DONE]" not in text
    # the engine saw the cancel; the replica counts a timeout (out of rotation until a trial serves)
    wait_until(lambda: replicas.total("cancelled") == cancelled + 1, timeout=5, what="engine call cancelled")
    assert replicas.total("active") == 0
    breaker = gateway.breaker(replica)
    assert not breaker.closed and breaker.suspect
    assert gateway.metric("kvgate_replica_requests_total", status="error") == errors + 1
    assert gateway.admitted("st") == 0
    # the stream sent two tokens: those are billed
    wait_until(lambda: gateway.usage("st")[0] == requests_before + 1, what="usage flushed")
    assert gateway.usage("st")[1] == tokens_before + 2


def test_a_non_streamed_answer_whose_replica_goes_silent_is_run_again_on_another(gateway):
    replicas = gateway.replicas
    replicas.fault(stall_after=2, calls=1)  # the first call (whichever replica) stalls; the rest answer
    requests_before, tokens_before = gateway.usage("st")
    retried = gateway.metric("kvgate_replica_requests_total", status="retried")
    before = {n: (replicas.counts(n).cancelled, replicas.counts(n).completed) for n in ("r0", "r1")}
    started = time.monotonic()
    response = gateway.chat("st", max_tokens=6, stop=["zzz"])  # a stop string: the engine streams
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == " hello" * 6  # one whole answer, not 2 + 6
    assert response.json()["usage"]["completion_tokens"] == 6
    assert STALL_S <= elapsed < STALL_S + 5, elapsed
    after = {n: (replicas.counts(n).cancelled - before[n][0], replicas.counts(n).completed - before[n][1])
             for n in ("r0", "r1")}
    stalled = next(n for n, (cancelled, _) in after.items() if cancelled == 1)
    served = "r1" if stalled == "r0" else "r0"
    assert response.headers["x-kvgate-replica"] == served
    assert after[served] == (0, 1) and after[stalled] == (1, 0)
    assert gateway.metric("kvgate_replica_requests_total", status="retried") == retried + 1
    assert gateway.breaker(stalled).suspect and gateway.breaker(served).closed
    # billed once, for the answer the client got
    wait_until(lambda: gateway.usage("st")[0] == requests_before + 1, what="usage flushed")
    assert gateway.usage("st")[1] == tokens_before + 6


def test_a_non_streamed_answer_silent_on_every_replica_is_a_504_and_not_billed(gateway):
    replicas = gateway.replicas
    replicas.fault(stall_after=2)
    requests_before, _ = gateway.usage("st")
    response = gateway.chat("st", max_tokens=6, stop=["zzz"])
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_timeout" and error["type"] == "timeout_error"
    assert response.headers.get("retry-after") == "1"
    # both replicas were tried once (one retry) and both calls cancelled
    wait_until(lambda: replicas.total("active") == 0, timeout=5, what="engine calls cancelled")
    assert replicas.counts("r0").cancelled >= 1 and replicas.counts("r1").cancelled >= 1
    # a later answer is billed; the 504 before it is not (usage batches flush in order)
    replicas.heal()
    gateway.reset_breakers()
    assert gateway.chat("st", max_tokens=3).status_code == 200
    wait_until(lambda: gateway.usage("st")[0] >= requests_before + 1, what="usage flushed")
    time.sleep(0.5)
    assert gateway.usage("st")[0] == requests_before + 1


def test_a_non_streamed_answer_whose_replica_dies_mid_answer_is_run_again_and_billed_once(gateway):
    replicas = gateway.replicas
    replicas.fault(die_after=3, calls=1)  # the first call dies after three tokens
    requests_before, tokens_before = gateway.usage("st")
    response = gateway.chat("st", max_tokens=8, stop=["zzz"])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == " hello" * 8
    assert response.json()["usage"]["completion_tokens"] == 8
    wait_until(lambda: gateway.usage("st")[0] == requests_before + 1, what="usage flushed")
    assert gateway.usage("st")[1] == tokens_before + 8  # not 3 + 8


def test_a_non_streamed_answer_that_dies_on_every_replica_is_a_503_and_not_billed(gateway):
    replicas = gateway.replicas
    replicas.fault(die_after=3)
    requests_before, _ = gateway.usage("st")
    response = gateway.chat("st", max_tokens=8, stop=["zzz"])
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_unavailable"
    replicas.heal()
    gateway.reset_breakers()
    assert gateway.chat("st", max_tokens=3).status_code == 200
    wait_until(lambda: gateway.usage("st")[0] >= requests_before + 1, what="usage flushed")
    time.sleep(0.5)
    assert gateway.usage("st")[0] == requests_before + 1


class _PacedClient:
    """An engine client yielding ``count`` one-token chunks, ``gap`` seconds apart, then
    (``hang``) nothing until cancelled; counts its calls' cancels."""

    def __init__(self, count: int, gap: float, hang: bool) -> None:
        self.count, self.gap, self.hang = count, gap, hang
        self.cancelled = 0

    async def generate(self, request, *, request_id, timeout=None):
        try:
            for i in range(self.count):
                await asyncio.sleep(self.gap)
                yield EngineChunk((7,), i + 1, KvMetrics(), i == self.count - 1 and not self.hang)
            if self.hang:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def close(self) -> None:
        pass


def _routed(client: _PacedClient, limit: float):
    pool = PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 10, 0, 30,
                        (ReplicaSnapshot(0, "r0", "127.0.0.1:9", "active", 1),))
    routing = Routing(RoutingConfig(first_token_timeout_s=5.0, inter_token_timeout_s=limit, retries=0))
    route = routing.route(pool)
    route.replicas[0].client = client
    request = EngineRequest((1, 2, 3), 8, None, True, SamplingParams(), RetentionPlan(), None, None)
    return routing.engine(pool), request, route.replicas[0]


def test_only_the_wait_for_the_engine_counts_not_the_consumers_time_between_chunks():
    async def scenario() -> None:
        limit = 0.2
        client = _PacedClient(count=4, gap=0.02, hang=False)
        engine, request, replica = _routed(client, limit)
        got = []
        async for chunk in engine.generate(request, request_id="slow-reader"):
            got.append(chunk)
            await asyncio.sleep(limit * 3)  # the consumer (a slow client) takes its time
        assert len(got) == 4 and client.cancelled == 0 and replica.breaker.closed

    asyncio.run(scenario())


def test_a_silent_engine_is_cancelled_at_the_deadline_and_counted_against_its_replica():
    async def scenario() -> None:
        limit = 0.3
        client = _PacedClient(count=2, gap=0.05, hang=True)
        engine, request, replica = _routed(client, limit)
        got = []
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineStalled) as stalled:
            async for chunk in engine.generate(request, request_id="silent"):
                got.append(chunk)
        waited = asyncio.get_running_loop().time() - started
        assert len(got) == 2 and client.cancelled == 1 and stalled.value.waited == limit
        assert limit <= waited < limit + 0.5, waited
        assert not replica.breaker.closed and replica.breaker.suspect and replica.in_flight == 0
        assert asyncio.current_task().cancelling() == 0  # the deadline's cancel was withdrawn

    asyncio.run(scenario())


def test_a_cancel_from_elsewhere_during_the_wait_stays_a_cancel():
    async def scenario() -> None:
        client = _PacedClient(count=1, gap=0.0, hang=True)
        engine, request, replica = _routed(client, 30.0)

        async def consume() -> None:
            async for _ in engine.generate(request, request_id="cancelled"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.cancelled == 1 and replica.breaker.closed and replica.in_flight == 0

    asyncio.run(scenario())
