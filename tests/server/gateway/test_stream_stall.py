"""A replica that fails or goes silent in the middle of an answer.

Streamed: once the first token went out the replica is final, so a replica that stops
sending must not keep the stream open forever. The inter-token deadline cancels the call
on the engine, counts a timeout in the replica's breaker, and ends the stream with the
dialect's error event. Non-streamed with stop strings (the engine streams, the client gets
the answer whole): nothing reached the client, so the answer is run again on another
replica, and only the answer the client got is billed; with no replica left it is a 504
(silent) or a 503 (died) in the API's error shape, and not billed.

The harness (scripted replicas, the gateway ``kvgate serve`` builds over HTTP) is
``tests/server/gateway/scripted.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from engines.contract import EngineRequest, KvMetrics, SamplingParams
from retention.types import RetentionPlan
from server.gateway.replicas.engine_client import EngineChunk
from server.gateway.replicas.routing import Routing, RoutingConfig
from server.gateway.replicas.stall import EngineStalled
from server.settings import Settings
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
from tests.server.gateway.scripted import ScriptedReplicas, sse_events, start_gateway, wait_until


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
