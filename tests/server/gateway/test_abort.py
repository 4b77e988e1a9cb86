"""The forced shutdown's abort of routed attempts (``server/gateway/replicas/abort.py``) and the
drain's signals, against a real RoutedEngine over an engine client that never finishes.

An abort ends an attempt waiting for its engine as :class:`GatewayShuttingDown` (the 503 path),
before the first token or mid-answer, with the inter-token deadline on or off; a cancel from
elsewhere pending in the same tick stays a cancel; the drain's second signal aborts at once, and
once the abort ran, the next signal stops the server.
"""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import pytest
import uvicorn

from engines.pool_stats import PoolStatsReport, TierStats
from server.gateway.drain import DrainingServer
from server.gateway.replicas.abort import GatewayShuttingDown
from server.gateway.replicas.routing import RoutedEngine, Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

TPB = 16
REQUEST = SimpleNamespace(input_ids=tuple(range(40)), max_new_tokens=8, streaming=True, cache_salt="s")


class Endless:
    """One chunk at once (unless ``first`` is False), then nothing until cancelled."""

    def __init__(self, first: bool = True) -> None:
        self.first = first
        self.cancelled = 0

    async def generate(self, request, *, request_id, timeout=None):
        try:
            if self.first:
                yield SimpleNamespace(kv=None, final=False, token_ids=(1,))
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def stats(self, timeout=5.0, *, events_since=None):
        return PoolStatsReport(TPB, TierStats(1000, 1000, 0), TierStats(0, 0, 0))

    async def close(self) -> None:
        pass


def routed(config: RoutingConfig, first: bool = True) -> tuple[Routing, RoutedEngine, Endless]:
    routing = Routing(config)
    route = routing.route(PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", TPB, 1000, 0, 30,
                                       (ReplicaSnapshot(0, "r0", "127.0.0.1:9000", "active", 1),)))
    client = Endless(first)
    route.replicas[0].client = client
    return routing, RoutedEngine(routing, route), client


async def consume(engine: RoutedEngine, out: list) -> None:
    async for chunk in engine.generate(REQUEST, request_id="r1"):
        out.append(chunk)


@pytest.mark.parametrize("stall", [30.0, 0.0])
@pytest.mark.parametrize("first", [True, False])
def test_an_abort_ends_the_wait_for_the_engine_as_shutting_down(stall: float, first: bool) -> None:
    async def run() -> None:
        routing, engine, client = routed(RoutingConfig(first_token_timeout_s=60.0, inter_token_timeout_s=stall), first)
        task = asyncio.create_task(consume(engine, []))
        await asyncio.sleep(0.01)
        assert routing.aborts.abort_all() == 1
        with pytest.raises(GatewayShuttingDown):
            await task
        assert client.cancelled == 1 and task.cancelling() == 0  # the engine call cancelled, the cancel withdrawn
        assert routing.aborts.abort_all() == 0  # the attempt left the set

    asyncio.run(run())


def test_a_cancel_already_pending_stays_a_cancel() -> None:
    async def run() -> None:
        routing, engine, _ = routed(RoutingConfig(first_token_timeout_s=60.0, inter_token_timeout_s=0.0))
        task = asyncio.create_task(consume(engine, []))
        await asyncio.sleep(0.01)
        task.cancel()  # e.g. the client gone, in the same tick as the shutdown's abort
        routing.aborts.abort_all()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_an_attempt_begun_after_the_abort_stops_before_it_waits() -> None:
    async def run() -> None:
        routing, engine, client = routed(RoutingConfig(first_token_timeout_s=60.0))
        routing.aborts.abort_all()
        with pytest.raises(GatewayShuttingDown):
            await consume(engine, [])
        assert client.cancelled == 0  # never waited on the engine

    asyncio.run(run())


def test_the_drains_signals_abort_then_stop() -> None:
    aborted: list[int] = []
    services = SimpleNamespace(draining=False, in_flight=1, abort_in_flight=lambda: aborted.append(1) or 1)

    async def run() -> None:
        # a second signal before the timeout: the abort at once
        server = DrainingServer(uvicorn.Config(app=lambda *a: None), services, drain_timeout=60.0, abort_grace=5.0)
        server.handle_exit(signal.SIGTERM, None)
        await server.on_tick(1)
        assert services.draining and not aborted
        server.handle_exit(signal.SIGTERM, None)
        await server.on_tick(2)
        assert aborted == [1] and not server.should_exit
        server.handle_exit(signal.SIGTERM, None)  # third: stop waiting for the answers
        assert server.should_exit
        # the timeout aborted first: the operator's next signal stops the server
        aborted.clear()
        server = DrainingServer(uvicorn.Config(app=lambda *a: None), services, drain_timeout=0.0, abort_grace=5.0)
        server.handle_exit(signal.SIGTERM, None)
        await server.on_tick(1)
        assert aborted == [1] and not server.should_exit
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit

    asyncio.run(run())
