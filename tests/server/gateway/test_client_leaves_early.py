"""A client that leaves before its response starts is noticed at once.

Before a response starts nothing is sent, so only the request's ``receive`` tells that the
client left (``http.disconnect``). A non-streamed answer is generated whole before anything
is sent, and a stream waits for its first token: in both, a client that left must cancel the
engine call then (not at the answer's end, billed for nobody), and the router must not retry
the request on another replica when the first-token deadline passes. No engine served it, so it
is not usage.

Two replicas (the KServe double of ``test_stream_stall``) that hold every call until it is
cancelled; a raw socket client sends a request and closes the connection once a replica
holds it.

The hot path reads the request's ``receive`` from ``streaming.CLIENT_RECEIVE``, which the
app's outermost middleware (``app.RequestIds``) sets for every ``/v1/`` request.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from server.gateway.replicas.routing import RoutingConfig
from tests.server.gateway.test_stream_stall import ScriptedReplicas, start_gateway, wait_until

DEADLINE_S = 3.0  # first-token deadline: the retry a departed client must not get would come after it

@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    routing = RoutingConfig(router="round-robin", first_token_timeout_s=DEADLINE_S, answer_timeout_per_token_s=0.0)
    built = start_gateway(tmp_path_factory.mktemp("leaves"), ScriptedReplicas(2), routing=routing)
    built.add_tenant("gone", max_concurrent_requests=1)
    yield built
    built.close()


def send(gateway, body: dict) -> socket.socket:
    """POST a chat completion on a raw socket (the caller closes it: the client leaves)."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {gateway.keys['gone']}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30)
    sock.sendall(head + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_before_the_answer_cancels_the_engine_call_at_once_and_is_not_retried(gateway, stream):
    replicas = gateway.replicas
    replicas.fault(hold=True)  # no replica sends anything until cancelled
    try:
        started, cancelled = replicas.total("started"), replicas.total("cancelled")
        gone = gateway.metric("kvgate_requests_total", tenant="gone", status="client_gone")
        billed = gateway.usage("gone")
        sock = send(gateway, gateway.body(stream=stream, max_tokens=4))
        wait_until(lambda: replicas.total("active") == 1, what="a replica holds the request")
        sock.close()
        left = time.monotonic()
        wait_until(lambda: replicas.total("cancelled") == cancelled + 1, timeout=DEADLINE_S + 5,
                   what="the engine call cancelled")
        took = time.monotonic() - left
        assert took < 1.0, f"the engine saw the cancel {took:.2f} s after the client left"
        # past the first-token deadline: no other replica got the request of a client that left
        time.sleep(DEADLINE_S + 0.5 - took)
        assert replicas.total("started") == started + 1
        assert replicas.total("active") == 0
        wait_until(lambda: gateway.admitted("gone") == 0, timeout=5, what="admission slot released")
        assert gateway.metric("kvgate_requests_total", tenant="gone", status="client_gone") == gone + 1
        route = gateway.services.routing.pools["scripted"]
        assert all(r.in_flight == 0 and r.breaker.closed for r in route.replicas.values())
        # no engine served it (no response, no token): not usage, as when the first-token deadline
        # ends the same wait (504); the usage flush (every 0.3 s) has run several times since
        assert gateway.usage("gone") == billed
    finally:
        replicas.heal()
    # the slot is free (limit 1): the next request is served, and billed
    response = gateway.chat("gone", max_tokens=2, stream=stream)
    assert response.status_code == 200, response.text
    wait_until(lambda: gateway.usage("gone")[0] == billed[0] + 1, timeout=5, what="the served request billed")
