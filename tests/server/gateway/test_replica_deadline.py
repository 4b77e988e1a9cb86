"""Streamed answers name their replica; a replica that accepts and never answers is retried.

Two real reference engines behind a real gateway (``fleet.py``). A replica is "hung" with
the engine's fault knob ``fault_first_token_hold_ms = -1``: it accepts every request and
holds it unscheduled until cancelled, while its stats call (the breaker's probe) keeps
answering, so only the gateway's first-token deadline can notice.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from tests.server.gateway.fleet import start_fleet

REPLICA = "x-kvgate-replica"
DEADLINE_S = 3.0  # first_token_timeout_s: far above a healthy first token here, short enough for a test


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundle):
    built = start_fleet(tmp_path_factory.mktemp("deadline"), bundle, replicas_count=2,
                        settings={"first_token_timeout_s": DEADLINE_S, "answer_timeout_per_token_s": 0.5})
    built.add_tenant("dl")
    yield built
    built.close()


@pytest.fixture(autouse=True)
def healthy(fleet):
    """Every test starts and ends with both replicas answering and in rotation."""
    yield
    for name in ("r0", "r1"):
        fleet.hang(name, 0)
    fleet.wait_until(lambda: all(fleet.engine_in_flight(n) == 0 for n in ("r0", "r1")), what="engines idle")

    def closed() -> bool:
        # A replica that timed out comes back only through a served trial request (breaker.py):
        # send one whenever a trial is due.
        breakers = [fleet.replica(n).breaker for n in ("r0", "r1")]
        if any(b.trial_due(time.monotonic()) for b in breakers):
            fleet.chat("dl", [{"role": "user", "content": "Are you back?"}], max_tokens=2)
        return all(b.closed for b in breakers)
    fleet.wait_until(closed, what="breakers closed")


def other(name: str) -> str:
    return "r1" if name == "r0" else "r0"


def sse_content(response: httpx.Response) -> tuple[str, list[dict]]:
    """The streamed text and the stream's events (``[DONE]`` excluded)."""
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    return text, events


def served(fleet, name: str) -> float:
    return fleet.metric("kvgate_replica_requests_total", replica=name, status="ok")


def test_a_streamed_answer_names_the_replica_that_served_it(fleet):
    for i in range(3):
        messages = [{"role": "user", "content": f"Name a colour, number {i}."}]
        chosen = fleet.decide("dl", messages)
        before = {n: served(fleet, n) for n in ("r0", "r1")}
        response = fleet.chat("dl", messages, stream=True, max_tokens=6)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        text, events = sse_content(response)
        assert text and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        # the header names the replica the router chose, and the one whose served count rose
        assert response.headers[REPLICA] == chosen
        after = {n: served(fleet, n) for n in ("r0", "r1")}
        assert after[chosen] == before[chosen] + 1 and after[other(chosen)] == before[other(chosen)]


@pytest.mark.parametrize("stream", [True, False])
def test_a_hung_replica_is_cancelled_and_the_request_retried_on_the_healthy_one(fleet, stream):
    messages = [{"role": "user", "content": f"Say hello ({'streamed' if stream else 'whole'})."}]
    hung = fleet.decide("dl", messages)  # the replica the first attempt goes to
    retried_before = fleet.metric("kvgate_replica_requests_total", replica=hung, status="retried")
    fleet.hang(hung)
    response = fleet.chat("dl", messages, stream=stream, max_tokens=4)
    assert response.status_code == 200, response.text
    # the answer came from the healthy replica, and the header says so (not the first choice)
    assert response.headers[REPLICA] == other(hung)
    text = sse_content(response)[0] if stream else response.json()["choices"][0]["message"]["content"]
    assert text
    # "retried" is counted where the breaker records the failure (routing.RoutedEngine)
    assert fleet.metric("kvgate_replica_requests_total", replica=hung, status="retried") == retried_before + 1
    # the deadline cancelled the attempt: the hung engine no longer holds the request
    fleet.wait_until(lambda: fleet.engine_in_flight(hung) == 0, timeout=10, what="hung engine freed")


@pytest.mark.parametrize("stream", [True, False])
def test_every_replica_hung_is_a_504_with_an_openai_error_body(fleet, stream):
    for name in ("r0", "r1"):
        fleet.hang(name)
    errors_before = sum(fleet.metric("kvgate_replica_requests_total", replica=n, status="error") for n in ("r0", "r1"))
    response = fleet.chat("dl", [{"role": "user", "content": "Anyone there?"}], stream=stream, max_tokens=4)
    assert response.status_code == 504, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == "engine_timeout" and error["type"] == "timeout_error" and error["message"]
    assert response.headers.get("retry-after") == "1"
    # both replicas were tried once (one retry), and neither engine still holds the request
    tried = {n: fleet.metric("kvgate_replica_requests_total", replica=n, status="retried")
             + fleet.metric("kvgate_replica_requests_total", replica=n, status="error") for n in ("r0", "r1")}
    assert sum(fleet.metric("kvgate_replica_requests_total", replica=n, status="error") for n in ("r0", "r1")) \
        == errors_before + 1
    assert all(v >= 1 for v in tried.values())
    fleet.wait_until(lambda: all(fleet.engine_in_flight(n) == 0 for n in ("r0", "r1")), timeout=10,
                     what="hung engines freed")
    # the gateway's own request metric records an engine error, not a server error
    assert fleet.metric("kvgate_requests_total", status="engine_error") >= 1


def test_a_hung_replica_waits_the_deadline_once_per_growing_open_period_and_returns_after_a_served_trial(fleet):
    """Its stats keep answering, yet no probe brings it back: after the first timeout only one
    trial request per open period goes there (open period doubling, capped), and once the
    hang is lifted the next trial is served and the replica is back in rotation.

    Round robin makes the hung replica every other request's first choice whenever it is in
    rotation (kv-aware routing would often avoid it by chance). Client-side bound: the k-th
    and (k+1)-th requests that waited the deadline D satisfy
    ``end[k+1] - start[k] >= 2 D + open_period(k)``: the k-th attempt timed out no earlier
    than ``start[k] + D``, the trial went no earlier than one open period later, and waited D.

    Which requests waited is read from the gateway's ``retried`` count around each request
    (in a burst: around the burst, and the trial is its longest request), not from their
    durations: on a loaded machine a healthy answer can itself take longer than D. The open
    periods are also checked on the breaker's own clock (``opened_at``, ``retry_at``), which
    the client's timings cannot loosen.
    """
    deadline, open_s, max_open_s = 2.0, 1.0, 4.0
    routing = fleet.gateways[0].app.state.gateway.routing
    saved = routing.config
    routing.config = replace(saved, first_token_timeout_s=deadline, breaker_open_s=open_s,
                             breaker_max_open_s=max_open_s)
    route = fleet.route()
    route.config = routing.config
    routing.use_router("round-robin")
    retried = lambda: fleet.metric("kvgate_replica_requests_total", replica="r0", status="retried")  # noqa: E731
    try:
        breaker = fleet.replica("r0").breaker
        fleet.hang("r0")
        before = retried()
        timed: list[tuple[float, float, str]] = []  # (start, end, replica header) per request
        slow: list[tuple[float, float, str]] = []  # the requests that waited the deadline there
        counter = iter(range(10_000))

        def one() -> tuple[float, float, str]:
            start = time.monotonic()
            response = fleet.chat("dl", [{"role": "user", "content": f"Count to {next(counter)}."}], max_tokens=2)
            assert response.status_code == 200, response.text
            return start, time.monotonic(), response.headers[REPLICA]

        opens: list[tuple[float, float, int]] = []  # the breaker after each attempt: opened_at, retry_at, failures
        with ThreadPoolExecutor(3) as pool:
            bursts = 0
            count = before
            give_up = time.monotonic() + 90
            # on a loaded machine a trial may fall to a single request (it became due while
            # the request was on its way), so run until two trials have met a burst
            while (count - before < 4 or bursts < 2) and time.monotonic() < give_up:
                if breaker.trial_due(time.monotonic()):
                    # a trial is due: of three concurrent requests only one may go there
                    burst = list(pool.map(lambda _: one(), range(3)))
                    after = retried()
                    assert after == count + 1, burst
                    slow.append(max(burst, key=lambda t: t[1] - t[0]))
                    timed += burst
                    bursts += 1
                else:
                    timed.append(one())
                    after = retried()
                    if after > count:
                        slow.append(timed[-1])
                if after > count:
                    opens.append((breaker.opened_at, breaker.retry_at, breaker.failures))
                count = after
        attempts = count - before
        assert attempts >= 4 and bursts >= 2, (attempts, bursts, slow)
        assert all(name == "r1" for _, _, name in timed)  # every answer came from the healthy one
        slow.sort(key=lambda t: t[0])
        assert len(slow) == len(opens) == attempts
        assert all(end - start >= deadline for start, end, _ in slow)
        assert len(timed) > 2 * attempts  # most requests never went near it
        # The breaker's own clock: every attempt reopened it for a period doubling up to the cap,
        # and the next attempt went no earlier than that period's end and waited the deadline.
        for k, (opened, retry, failures) in enumerate(opens, 1):
            assert failures == k
            assert retry - opened == pytest.approx(min(max_open_s, open_s * 2 ** (k - 1)))
            if k > 1:
                assert opened - opens[k - 2][1] >= deadline - 1e-3, (k, opens)
        for k in range(1, len(slow)):  # and the same seen from the client
            period = min(max_open_s, open_s * 2 ** (k - 1))
            assert slow[k][1] - slow[k - 1][0] >= 2 * deadline + period, (k, slow)
        # the stats probe kept answering all along, yet it is still out of rotation
        assert not breaker.closed and breaker.suspect and fleet.replica("r0").stats is not None
        fleet.wait_until(lambda: fleet.engine_in_flight("r0") == 0, timeout=10, what="hung engine freed")

        # the hang ends: nothing reaches it before the trial is due, then the trial is served
        fleet.hang("r0", 0)
        served_before = served(fleet, "r0")
        fleet.wait_until(lambda: breaker.trial_due(time.monotonic()), timeout=max_open_s + 5, what="trial due")
        _, _, name = one()
        # served there (a request that waited the deadline would have been answered by r1)
        assert name == "r0" and breaker.closed and not breaker.suspect
        names = [one()[2] for _ in range(4)]
        assert names.count("r0") == 2 and names.count("r1") == 2  # back in rotation
        assert served(fleet, "r0") == served_before + 3
        assert retried() - before == attempts
    finally:
        fleet.hang("r0", 0)
        routing.config = saved
        route.config = saved
        routing.use_router(saved.router)


def usage_of(fleet, slug: str) -> tuple[int, int]:
    """(requests, prompt tokens) the registry holds for ``slug`` (flushed every 0.5 s here)."""
    from sqlalchemy import func, select

    from tenants.models import Tenant, Usage
    with fleet.session_factory() as session:
        row = session.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                     func.coalesce(func.sum(Usage.prompt_tokens), 0))
                              .join(Tenant, Tenant.id == Usage.tenant_id).where(Tenant.slug == slug)).one()
    return int(row[0]), int(row[1])


def test_a_request_no_replica_served_is_not_billed(fleet):
    """A 504 engine_timeout (every replica hung, nothing generated) is no usage; the served
    requests around it are. The second served request's usage is recorded after the 504's
    would have been, and batches flush in order, so once it is in, the 504's would be too."""
    fleet.add_tenant("billed")
    messages = [{"role": "user", "content": "Bill me once."}]
    first = fleet.chat("billed", messages, max_tokens=2)
    assert first.status_code == 200, first.text
    prompt = first.json()["usage"]["prompt_tokens"]
    fleet.wait_until(lambda: usage_of(fleet, "billed")[0] == 1, timeout=30, what="first usage flushed")
    for name in ("r0", "r1"):
        fleet.hang(name)
    refused = fleet.chat("billed", [{"role": "user", "content": "Anyone home?"}], max_tokens=2)
    assert refused.status_code == 504, refused.text
    for name in ("r0", "r1"):
        fleet.hang(name, 0)
    fleet.wait_until(lambda: all(fleet.engine_in_flight(n) == 0 for n in ("r0", "r1")), what="engines idle")

    def served_again() -> bool:  # breakers reopen only through a served trial (breaker.py)
        breakers = [fleet.replica(n).breaker for n in ("r0", "r1")]
        if any(b.trial_due(time.monotonic()) for b in breakers):
            fleet.chat("dl", [{"role": "user", "content": "Are you back?"}], max_tokens=2)
        return any(b.closed for b in breakers)
    fleet.wait_until(served_again, what="a replica back in rotation")
    second = fleet.chat("billed", messages, max_tokens=2)
    assert second.status_code == 200, second.text
    fleet.wait_until(lambda: usage_of(fleet, "billed")[0] >= 2, timeout=30, what="second usage flushed")
    assert usage_of(fleet, "billed") == (2, prompt + second.json()["usage"]["prompt_tokens"])
