"""Streamed answers name their replica; a replica that accepts and never answers is retried.

Two real reference engines behind a real gateway (``fleet.py``). A replica is "hung" with
the engine's fault knob ``fault_first_token_hold_ms = -1``: it accepts every request and
holds it unscheduled until cancelled, while its stats call (the breaker's probe) keeps
answering, so only the gateway's first-token deadline can notice.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from engines.reference.loader import load_model
from tests.server.gateway.fleet import start_fleet

REPLICA = "x-kvgate-replica"
DEADLINE_S = 3.0  # first_token_timeout_s: far above a healthy first token here, short enough for a test


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(1)
    return load_model()


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
    fleet.wait_until(lambda: all(fleet.replica(n).breaker.closed for n in ("r0", "r1")), what="breakers closed")


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
