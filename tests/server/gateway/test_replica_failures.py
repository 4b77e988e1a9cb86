"""What a replica's failures do to the requests on it and to the poll loop.

* An error the engine answers a request with is the request's fault (400, never retried) only
  when it is a known refusal (``engines/refusals.is_refusal``: the contract's marked validation
  errors, the prompt / output / guide refusals); any other is the engine's own failure, retried
  on another replica and counted by its breaker; TensorRT-LLM's full queue is overload, retried
  without opening the breaker, and 503 ``engine_overloaded`` with ``Retry-After`` when every
  replica is full.
* A replica whose stats call hangs delays only itself: the healthy replicas keep being polled
  every round, and the pool's state keeps being refreshed.
* When a replica's breaker opens because it is unreachable, the attempts waiting there for their
  first token are cancelled and retried elsewhere at once, not left to their own deadline.

Scripted replicas (``scripted.py``) whose stats and generation are steered per replica here, and a
real reference engine for the engine's side of the refusal marker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2

from engines.contract import ContractError, EngineRequest, KvMetrics, SamplingParams
from engines.refusals import CONTRACT_REFUSAL, contract_refused, is_refusal, overloaded, too_long
from retention.types import RetentionPlan
from server.gateway.api.engine_errors import engine_error
from server.gateway.replicas.engine_client import (
    EngineChunk, EngineClient, EngineFailed, EngineOverloaded, EngineRejected, EngineUnavailable, answered_error,
)
from server.gateway.replicas.routing import PoolRoute, Replica, Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
from tests.server.gateway import scripted
from tests.server.gateway.scripted import POOL, ScriptedReplicas, sse_events, start_gateway, wait_until

QUEUE_FULL = ("engine error: Maximum queue size of 64 has been reached, please try again later "
              "(/src/tensorrt_llm/cpp/tensorrt_llm/executor/executorImpl.cpp:1034)")


# The classification, pure ----------------------------------------------------------------------
class _Job:
    kind, output_param, format_param, guide, tools = "chat", "max_tokens", "response_format", None, None


def test_an_answered_error_is_a_refusal_only_when_known_and_maps_to_the_api():
    refused = ContractError("temperature must be finite and >= 0, got -1.0", tensor="temperature")
    assert refused.refusal.startswith(CONTRACT_REFUSAL) and is_refusal(f"[kvgate_llm] {refused.refusal}")
    for message in (f"[kvgate_llm] {refused.refusal}", contract_refused("top_logprobs: not served"),
                    "[kvgate_llm] " + too_long(900, 640), "request_output_len must be within [1, 64], got 99",
                    "Prompt length (900) exceeds maximum input length (640). Set log level to info"):
        assert isinstance(answered_error(message), EngineRejected), message
    assert overloaded(QUEUE_FULL) == 64
    assert type(answered_error(QUEUE_FULL)) is EngineOverloaded
    for message in ("engine error: [TensorRT-LLM][ERROR] Encountered an error in forwardAsync",
                    "[kvgate_llm] the reference engine is not running",
                    "[kvgate_llm] internal error: RuntimeError: boom", "temperature must be finite"):
        assert type(answered_error(message)) is EngineFailed, message

    busy = engine_error(answered_error(QUEUE_FULL), _Job())
    assert (busy.status, busy.code, busy.headers.get("Retry-After")) == (503, "engine_overloaded", "1")
    failed = engine_error(answered_error("engine error: executor failed"), _Job())
    assert (failed.status, failed.code, failed.headers.get("Retry-After")) == (503, "engine_unavailable", "1")
    rejected = engine_error(answered_error(f"[kvgate_llm] {refused.refusal}"), _Job())
    assert (rejected.status, rejected.code) == (400, "engine_rejected")


async def test_the_reference_engine_marks_contract_refusals_and_not_its_own_failures(bundle):
    from engines.reference.config import ReferenceEngineConfig
    from engines.reference.server import start_reference_server

    running = await start_reference_server(ReferenceEngineConfig(primary_blocks=40, secondary_blocks=0, max_input_len=64, max_output_len=8), port=0,
                                           bundle=bundle)
    client = EngineClient(f"127.0.0.1:{running.port}", "kvgate_llm")
    try:
        for streaming in (False, True):
            bad = EngineRequest((1, 2, 3), 2, None, streaming, SamplingParams(temperature=-1.0), RetentionPlan(),
                                None, None)
            with pytest.raises(EngineRejected, match=CONTRACT_REFUSAL):
                async for _ in client.generate(bad, request_id=secrets.token_hex(4), timeout=30):
                    pass
        await asyncio.to_thread(running.engine.stop)  # the engine stops, its gRPC server stays up
        for streaming in (False, True):
            good = EngineRequest((1, 2, 3), 2, None, streaming, SamplingParams(), RetentionPlan(), None, None)
            with pytest.raises(EngineFailed, match="not running"):
                async for _ in client.generate(good, request_id=secrets.token_hex(4), timeout=30):
                    pass
    finally:
        await client.close()
        await running.stop(None)


# Scripted replicas steered per replica -----------------------------------------------------------
class Steer:
    """Per replica name: ``stats`` "hang" / "fail" / None, ``error`` an error message every generation
    call is answered with, ``hold`` generation calls wait until cancelled."""

    def __init__(self) -> None:
        self.stats: dict[str, str | None] = {}
        self.error: dict[str, str | None] = {}
        self.hold: set[str] = set()
        self.stats_calls: dict[str, int] = {}
        self.errors_sent: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.cancelled: dict[str, int] = {}

    def clear(self) -> None:
        self.stats.clear()
        self.error.clear()
        self.hold.clear()


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    steer = Steer()
    original_infer, original_stream = scripted._Replica.ModelInfer, scripted._Replica.ModelStreamInfer

    async def model_infer(self, request, context):
        mode = steer.stats.get(self.name)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica down")
        steer.stats_calls[self.name] = steer.stats_calls.get(self.name, 0) + 1
        return await original_infer(self, request, context)

    async def model_stream_infer(self, request_iterator, context):
        error = steer.error.get(self.name)
        if error is not None:
            async for request in request_iterator:
                steer.errors_sent[self.name] = steer.errors_sent.get(self.name, 0) + 1
                yield service_pb2.ModelStreamInferResponse(
                    error_message=error, infer_response=service_pb2.ModelInferResponse(id=request.id))
            return
        if self.name in steer.hold:
            async for _ in request_iterator:
                steer.held[self.name] = steer.held.get(self.name, 0) + 1
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    steer.cancelled[self.name] = steer.cancelled.get(self.name, 0) + 1
                    raise
            return
        async for message in original_stream(self, request_iterator, context):
            yield message

    # Patched on the class before the servers register their handlers (bound at registration).
    scripted._Replica.ModelInfer, scripted._Replica.ModelStreamInfer = model_infer, model_stream_infer
    try:
        replicas = ScriptedReplicas(2)
    finally:
        scripted._Replica.ModelInfer, scripted._Replica.ModelStreamInfer = original_infer, original_stream
    routing = RoutingConfig(router="round-robin", first_token_timeout_s=30.0, stats_timeout_s=5.0)
    gateway = start_gateway(tmp_path_factory.mktemp("failures"), replicas, routing=routing)
    gateway.add_tenant("f", max_concurrent_requests=16)
    yield gateway, steer
    steer.clear()
    gateway.close()


@pytest.fixture(autouse=False)
def gw(steered):
    gateway, steer = steered
    steer.clear()
    gateway.reset_breakers()
    wait_until(lambda: gateway.replicas.total("active") == 0, what="engines idle")
    yield gateway, steer
    steer.clear()
    wait_until(lambda: gateway.replicas.total("active") == 0, what="engines idle")
    gateway.reset_breakers()


def _ok_replica(response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-replica"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_answered_as_an_error_is_retried_elsewhere_and_opens_the_breaker(gw, stream):
    gateway, steer = gw
    steer.error["r0"] = "engine error: [TensorRT-LLM][ERROR] Encountered an error in forwardAsync"
    served = [_ok_replica(gateway.chat("f", stream=stream)) for _ in range(3)]
    assert served == ["r1"] * 3 and steer.errors_sent.get("r0", 0) >= 1
    assert gateway.breaker("r0").opened_at > float("-inf")  # counted (a probe may have closed it since)
    assert gateway.metric("kvgate_replica_requests_total", replica="r0", status="retried") >= 1


def test_a_full_queue_is_retried_elsewhere_without_opening_the_breaker_and_is_503_when_every_queue_is_full(gw):
    gateway, steer = gw
    steer.error["r0"] = QUEUE_FULL
    assert [_ok_replica(gateway.chat("f")) for _ in range(3)] == ["r1"] * 3
    assert steer.errors_sent.get("r0", 0) >= 1
    assert gateway.breaker("r0").opened_at == float("-inf") and gateway.breaker("r0").closed
    steer.error["r1"] = QUEUE_FULL
    for stream in (False, True):
        response = gateway.chat("f", stream=stream)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_overloaded"
        assert response.headers["retry-after"] == "1"
    assert gateway.breaker("r0").closed and gateway.breaker("r1").closed


def test_a_contract_refusal_is_a_400_sent_to_one_replica_only(gw):
    gateway, steer = gw
    message = "[kvgate_llm] " + contract_refused("stop_words: too many stop sequences")
    steer.error["r0"] = steer.error["r1"] = message
    before = sum(steer.errors_sent.values())
    response = gateway.chat("f")
    assert response.status_code == 400 and response.json()["error"]["code"] == "engine_rejected", response.text
    assert sum(steer.errors_sent.values()) == before + 1  # never retried
    assert gateway.breaker("r0").opened_at == gateway.breaker("r1").opened_at == float("-inf")


def test_a_replica_whose_stats_hang_delays_only_itself(gw):
    gateway, steer = gw
    monitor = gateway.services.monitor
    steer.stats["r1"] = "hang"
    time.sleep(0.5)  # the polls already under way land
    calls, refreshed, started = steer.stats_calls.get("r0", 0), [], time.monotonic()
    while time.monotonic() - started < 3.0:
        stamp = monitor.last_refresh.get(POOL)
        if not refreshed or stamp != refreshed[-1]:
            refreshed.append(stamp)
        time.sleep(0.02)
    gaps = [b - a for a, b in zip(refreshed, refreshed[1:])]
    # pool_poll is 0.2 s and the hung call's timeout 5 s: every round refreshes the pool and polls r0
    assert len(gaps) >= 4 and max(gaps) < 1.0, gaps
    assert steer.stats_calls.get("r0", 0) - calls >= 5
    steer.stats["r1"] = None


@pytest.mark.parametrize("stream", [False, True])
def test_attempts_waiting_on_a_replica_that_goes_down_are_retried_elsewhere_at_once(gw, stream):
    gateway, steer = gw
    steer.hold.add("r1")
    requests_before, tokens_before = gateway.usage("f")
    with ThreadPoolExecutor(2) as pool:  # round robin: one of the two lands on r1 and waits there
        started = time.monotonic()
        futures = [pool.submit(gateway.chat, "f", stream=stream, max_tokens=8) for _ in range(2)]
        wait_until(lambda: steer.held.get("r1", 0) >= 1, what="an attempt held on r1")
        steer.stats["r1"] = "hang"  # its next stats poll gets no answer in 5 s: the breaker opens (it hangs)
        responses = [f.result() for f in futures]
        took = time.monotonic() - started
    assert [_ok_replica(r) for r in responses] == ["r0", "r0"]
    assert took < 10.0  # not the 30 s first-token deadline (non-streamed: 30 + 8 × 0.5 s)
    if stream:
        assert all(len([e for e in sse_events(r.text) if e.get("choices")]) >= 8 for r in responses)
    wait_until(lambda: steer.cancelled.get("r1", 0) >= 1, what="the held call cancelled on the engine")
    assert not gateway.breaker("r1").closed or gateway.breaker("r1").opened_at > float("-inf")
    wait_until(lambda: gateway.usage("f") == (requests_before + 2, tokens_before + 16), what="usage flushed")
    time.sleep(0.5)
    assert gateway.usage("f") == (requests_before + 2, tokens_before + 16)  # once per request


# The router with fake clients: eviction only before the first chunk ---------------------------------
STREAMED = EngineRequest((1, 2, 3), 2, None, True, SamplingParams(), RetentionPlan(), None, None)


def _one_replica(client, *, address: str = "127.0.0.1:9000",
                 **config) -> tuple[Routing, PoolSnapshot, PoolRoute, Replica]:
    """Routing (``RoutingConfig(**config)``) over pool ``p`` of one active replica ``r0`` at ``address``,
    with ``client`` as that replica's engine: ``(routing, pool, route, replica)``."""
    routing = Routing(RoutingConfig(**config))
    pool = PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 10, 0, 30,
                        (ReplicaSnapshot(0, "r0", address, "active", 1),))
    route = routing.route(pool)
    replica = route.replicas[0]
    replica.client = client
    return routing, pool, route, replica


class _Fake:
    def __init__(self, first: bool) -> None:
        self.first = first  # send one chunk, then hang
        self.started = asyncio.Event()

    async def generate(self, request, *, request_id, timeout=None):
        self.started.set()
        if self.first:
            yield EngineChunk((1,), 1, KvMetrics(), False)
        await asyncio.Event().wait()
        yield EngineChunk((2,), 2, KvMetrics(), True)

    async def stats(self, timeout=5.0, *, events_since=None):
        raise EngineUnavailable("down")

    async def close(self) -> None:
        pass


def test_an_attempt_that_has_had_its_first_chunk_is_never_evicted():
    async def scenario() -> None:
        routing, pool, route, replica = _one_replica(_Fake(first=True), router="round-robin", first_token_timeout_s=0)
        chunks = []

        async def consume() -> None:
            async for chunk in routing.engine(pool).generate(STREAMED, request_id="x"):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        assert chunks and not replica.waiting
        route.mark_failed(replica)  # the breaker opens on unavailability
        assert not replica.breaker.closed
        await asyncio.sleep(0.05)
        assert not task.done()  # still its replica's: no retry after the first chunk
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await routing.close()

    asyncio.run(scenario())


class _AnsweringStats:
    """A replica that is up: it prefills (first chunk after 0.3 s) and answers its stats call with
    ``stats_exc`` (an unreadable answer, or an engine failure it reports)."""

    def __init__(self, stats_exc: Exception) -> None:
        self.stats_exc = stats_exc

    async def generate(self, request, *, request_id, timeout=None):  # noqa: ANN001, ANN201
        await asyncio.sleep(0.3)
        yield EngineChunk((2,), 2, KvMetrics(), True)

    async def stats(self, timeout=5.0, *, events_since=None):  # noqa: ANN001, ANN201
        raise self.stats_exc

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("stats_exc", [ValueError("stats JSON of a newer engine"), EngineFailed("executor error")],
                         ids=["unreadable", "engine-failed"])
def test_a_failed_probe_of_a_replica_that_answered_leaves_its_waiting_requests_alone(stats_exc):
    """The poll opens the breaker (no new requests go there), but the replica answered: it is up, so
    the request already waiting there for its first chunk runs on (only an unreachable replica's are
    moved)."""
    async def scenario() -> list:
        routing, pool, route, replica = _one_replica(_AnsweringStats(stats_exc), router="round-robin",
                                                     first_token_timeout_s=0)

        async def consume() -> list:
            return [c async for c in routing.engine(pool).generate(STREAMED, request_id="x")]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        assert replica.waiting
        await route.poll(replica)
        assert not replica.breaker.closed  # a failed probe all the same
        chunks = await task
        await routing.close()
        return chunks

    assert [c.token_ids for c in asyncio.run(scenario())] == [(2,)]


def test_a_late_failed_poll_of_a_replaced_replica_leaves_the_new_ones_index_and_breaker():
    """Polls outlive a round: the poll of an endpoint replaced under the same replica id (a new
    address) that fails late must not drop the new replica's index nor open its breaker."""
    class Hanging:
        def __init__(self) -> None:
            self.go = asyncio.Event()

        async def stats(self, timeout=5.0, *, events_since=None):  # noqa: ANN001, ANN201
            await self.go.wait()
            raise EngineUnavailable("old endpoint gone")

        async def close(self) -> None:
            return None

    async def scenario() -> None:
        routing, snap, route, old = _one_replica(Hanging(), address="10.0.0.1:9000", router="kv-aware",
                                                 poll_wait_s=0.05)
        route.sync(snap)
        route.start_poll(old)
        await asyncio.sleep(0.01)  # the old endpoint's poll is in flight
        route.sync(dataclasses.replace(snap, replicas=(ReplicaSnapshot(0, "r0", "10.0.0.2:9000", "active", 1),)))
        new = route.replicas[0]
        assert new is not old
        new.cursor, new.events = 42, True  # as after polls of the new engine
        route.router.index(0)
        old.client.go.set()
        await asyncio.sleep(0.05)  # the old poll fails now
        assert 0 in route.router._indexes and new.cursor == 42  # noqa: SLF001 - the index the router routes on
        assert new.breaker.closed
        await routing.close()

    asyncio.run(scenario())
