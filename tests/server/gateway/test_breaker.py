"""The replica breaker's state machine (pure, explicit ``now``) and its use by the router's
dispatch (fake engine clients, an injected clock): a replica that timed out is not closed by
its stats probe, gets one trial request per open period, and closes only when served."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from engines.contract import EngineRequest, KvMetrics, SamplingParams
from engines.pool_stats import PoolStatsReport, TierStats
from retention.types import RetentionPlan
from server.gateway.replicas.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from server.gateway.replicas.engine_client import EngineChunk, EngineTimeout, EngineUnavailable
from server.gateway.replicas.routing import RoutingConfig, Routing
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

OPEN_S, MAX_S = 1.0, 4.0


# The state machine --------------------------------------------------------------------------

def test_connection_failures_keep_the_probe_closing_the_breaker() -> None:
    b = Breaker()
    assert b.fail(10.0, OPEN_S, MAX_S) and b.state == OPEN and not b.suspect
    assert not b.trial_due(11.0)  # no trials for connection failures: the probe decides
    assert not b.avoid(10.5)  # still usable as a last-resort probe
    assert b.probe_due(11.0) and b.probe_ok() and b.closed


def test_a_timeout_is_not_closed_by_the_probe_and_gets_one_trial_per_open_period() -> None:
    b = Breaker()
    assert b.time_out(10.0, 9.0, OPEN_S, MAX_S) is True
    assert b.state == OPEN and b.suspect and b.retry_at == 11.0
    assert b.probe_ok() is False and b.state == OPEN  # its stats answer while it hangs
    assert b.avoid(10.9) and not b.trial_due(10.9) and not b.start_trial(10.9)
    assert b.start_trial(11.0) and b.state == HALF_OPEN
    assert b.avoid(11.0) and not b.start_trial(11.0)  # exactly one trial in flight
    assert b.probe_ok() is False and b.state == HALF_OPEN
    # the trial times out too: open again, for twice as long
    assert b.time_out(13.0, 11.0, OPEN_S, MAX_S) is False
    assert b.state == OPEN and b.retry_at == 15.0
    assert b.start_trial(15.0)
    b.time_out(17.0, 15.0, OPEN_S, MAX_S)
    assert b.retry_at == 21.0
    assert b.start_trial(21.0)
    b.time_out(23.0, 21.0, OPEN_S, MAX_S)
    assert b.retry_at == 23.0 + MAX_S  # capped
    # after the hang: the next trial is served, which alone closes it and forgets the history
    assert b.start_trial(27.0) and b.served() is True
    assert b.state == CLOSED and b.failures == 0 and not b.suspect and not b.avoid(27.0)


def test_a_timeout_of_an_attempt_sent_before_the_breaker_opened_is_the_same_incident() -> None:
    b = Breaker()
    b.time_out(10.0, 8.0, OPEN_S, MAX_S)
    assert b.time_out(10.2, 8.5, OPEN_S, MAX_S) is False  # dispatched before 10.0
    assert b.failures == 1 and b.retry_at == 11.0
    assert b.start_trial(11.0)
    b.time_out(11.5, 9.0, OPEN_S, MAX_S)  # a stale attempt ends during the trial
    assert b.state == HALF_OPEN and b.failures == 1


def test_a_trial_without_a_verdict_frees_the_trial_and_a_connection_failure_keeps_the_suspicion() -> None:
    b = Breaker()
    b.time_out(10.0, 9.0, OPEN_S, MAX_S)
    assert b.start_trial(11.0)
    b.end_trial()  # e.g. the client left before the first token
    assert b.state == OPEN and b.trial_due(11.0)
    assert b.start_trial(11.1)
    b.fail(11.2, OPEN_S, MAX_S)  # the engine dropped the trial's connection
    assert b.state == OPEN and b.suspect and b.retry_at == 13.2
    assert b.probe_ok() is False  # even after a restart it must serve once to be trusted
    b.end_trial()  # no-op outside half-open
    assert b.state == OPEN


def test_a_timeout_of_an_attempt_queued_while_the_replica_kept_serving_is_overload_not_a_hang() -> None:
    b = Breaker()
    b.served(12.0)  # another request got its first token after this attempt was sent at 11.0
    assert b.time_out(21.0, 11.0, OPEN_S, MAX_S) is False
    assert b.closed and not b.suspect and b.failures == 0 and not b.avoid(21.0)
    # an attempt sent after the last first token the replica gave: nothing served since, a hang
    assert b.time_out(23.0, 12.5, OPEN_S, MAX_S) is True and b.suspect and b.state == OPEN
    # once open, a served-before attempt's timeout is the same incident, not overload relief
    assert b.time_out(23.5, 11.5, OPEN_S, MAX_S) is False and b.state == OPEN and b.failures == 1


def test_a_request_served_by_a_replica_that_only_looked_unreachable_closes_it() -> None:
    b = Breaker()
    b.fail(10.0, OPEN_S, MAX_S)
    assert b.served() is True and b.closed
    assert Breaker().served() is False


# Dispatch with fake replicas ------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    """An engine client: ``hung`` holds every request until cancelled; stats always answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hung = False
        self.calls = 0
        self.held = 0

    async def generate(self, request, *, request_id, timeout=None):
        self.calls += 1
        if self.hung:
            self.held += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.held -= 1
        yield EngineChunk((1,), 1, KvMetrics(), True)

    async def stats(self, timeout=5.0, *, events_since=None):
        return PoolStatsReport(16, TierStats(10, 10, 0), TierStats(0, 0, 0))

    async def close(self) -> None:
        pass


def _pool() -> PoolSnapshot:
    return PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 10, 0, 30,
                        tuple(ReplicaSnapshot(i, f"r{i}", f"127.0.0.1:{9000 + i}", "active", 1) for i in range(2)))


def _request() -> EngineRequest:
    return EngineRequest((1, 2, 3), 2, None, True, SamplingParams(), RetentionPlan(), None, None)


def _setup():
    """Built inside the event loop (an engine client's channel needs one)."""
    clock = Clock()
    routing = Routing(RoutingConfig(router="round-robin", breaker_open_s=OPEN_S, breaker_max_open_s=MAX_S,
                                    first_token_timeout_s=0.05), clock=clock)
    pool = _pool()
    route = routing.route(pool)
    fakes = {}
    for replica in route.replicas.values():
        fakes[replica.name] = replica.client = FakeClient(replica.name)
    return clock, routing, pool, route, fakes


async def _serve(routing, pool) -> str:
    engine = routing.engine(pool)
    async for _ in engine.generate(_request(), request_id=secrets.token_hex(4)):
        pass
    return engine.replica


def test_a_hung_replica_gets_one_trial_per_open_period_and_returns_when_a_trial_is_served() -> None:
    async def scenario() -> None:
        clock, routing, pool, route, fakes = _setup()
        hung = fakes["r0"]
        hung.hung = True
        # round robin: requests alternate until r0 times out once (retried on r1)
        for _ in range(4):
            assert await _serve(routing, pool) == "r1" or hung.calls == 0
        assert hung.calls == 1
        breaker = route.replicas[0].breaker
        assert breaker.suspect and breaker.state == OPEN
        # the poll loop's probe answers but does not close it
        clock.now += OPEN_S + 0.1
        await routing.poll(pool)
        assert breaker.state == OPEN
        # the trial is due: the next request goes there (and is retried), the rest avoid it
        assert await _serve(routing, pool) == "r1"
        assert hung.calls == 2 and breaker.state == OPEN and breaker.retry_at == clock.now + 2 * OPEN_S
        for _ in range(5):
            assert await _serve(routing, pool) == "r1"
        assert hung.calls == 2
        # the hang ends; nothing goes there before the (doubled) open period is over
        hung.hung = False
        clock.now += 2 * OPEN_S
        assert await _serve(routing, pool) == "r0"  # the trial, served
        assert breaker.closed and not breaker.suspect and hung.calls == 3
        served = {await _serve(routing, pool) for _ in range(4)}
        assert served == {"r0", "r1"}  # back in rotation
        assert hung.held == 0

    asyncio.run(scenario())


def test_concurrent_requests_send_a_single_trial() -> None:
    async def scenario() -> None:
        clock, routing, pool, route, fakes = _setup()
        breaker = route.replicas[0].breaker
        breaker.time_out(clock.now, clock.now, OPEN_S, MAX_S)
        clock.now += OPEN_S
        fakes["r0"].hung = True
        served = await asyncio.gather(*(_serve(routing, pool) for _ in range(6)))
        assert served == ["r1"] * 6
        assert fakes["r0"].calls == 1  # one trial, the other five avoided it

    asyncio.run(scenario())


def test_with_every_replica_timed_out_requests_fail_fast_until_a_trial_is_due() -> None:
    async def scenario() -> None:
        clock, routing, pool, route, fakes = _setup()
        for fake in fakes.values():
            fake.hung = True
        with pytest.raises(EngineTimeout):
            await _serve(routing, pool)
        assert sum(f.calls for f in fakes.values()) == 2
        with pytest.raises(EngineUnavailable) as caught:  # no wait: both are known to hang
            await _serve(routing, pool)
        assert not isinstance(caught.value, EngineTimeout)
        assert sum(f.calls for f in fakes.values()) == 2
        clock.now += OPEN_S
        fakes["r1"].hung = False
        # both trials are due: the first attempt tries one, the retry the other
        assert await _serve(routing, pool) == "r1"
        assert route.replicas[1].breaker.closed

    asyncio.run(scenario())


def test_a_suspect_replicas_capacity_and_tenant_blocks_leave_the_quota_sums_together() -> None:
    """Its stats keep answering while it hangs, yet it takes no new blocks: both sides of a
    tenant's quota ratio drop it, and it counts again once a served trial closes its breaker."""

    async def scenario() -> None:
        clock, routing, pool, route, fakes = _setup()
        for name, held in (("r0", 6), ("r1", 2)):
            async def stats(timeout=5.0, *, events_since=None, held=held):
                return PoolStatsReport(16, TierStats(10, held, 10 - held), TierStats(0, 0, 0), tenants={"7": [held, 0]})
            fakes[name].stats = stats
        await routing.poll(pool)
        both = route.pool_stats()
        assert both.primary.max_blocks == 20 and both.tenants == {"7": [8, 0]}
        route.replicas[0].breaker.time_out(clock.now, clock.now, OPEN_S, MAX_S)
        clock.now += OPEN_S
        await routing.poll(pool)  # the suspect's stats answer...
        assert route.replicas[0].stats is not None
        alone = route.pool_stats()  # ... but it is out of rotation: capacity and blocks both go
        assert alone.primary.max_blocks == 10 and alone.tenants == {"7": [2, 0]}
        assert await _serve(routing, pool) == "r0"  # the trial is served: back in rotation
        assert route.pool_stats().primary.max_blocks == 20 and route.pool_stats().tenants == {"7": [8, 0]}

    asyncio.run(scenario())
