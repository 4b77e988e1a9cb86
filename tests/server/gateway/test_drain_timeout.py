"""A drain that runs out of time ends what still runs in the API's words, then exits.

Past ``--drain-timeout`` (or at a second signal) the gateway ends the engine calls still
running: a request whose answer had not started gets 503 ``shutting_down`` with
``Retry-After`` in its dialect's shape, a stream ends with the error event, both engine calls
are cancelled, usage is billed for what was sent, and the server stops. Left to uvicorn these
requests got a plain-text 500 and a stream cut without an error. The gateway is served by
``kvgate serve``'s own DrainingServer; the signal is delivered as its handler receives it.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from server.gateway.replicas.routing import RoutingConfig
from tests.server.gateway.scripted import ScriptedReplicas, sse_events, start_gateway, wait_until

DRAIN_S = 1.0


def test_requests_still_running_at_the_drain_timeout_answer_503_shutting_down_and_the_server_exits(tmp_path):
    routing = RoutingConfig(router="round-robin", first_token_timeout_s=60.0, inter_token_timeout_s=0.0)
    gateway = start_gateway(tmp_path, ScriptedReplicas(2), routing=routing, drain_timeout=DRAIN_S)
    try:
        gateway.add_tenant("dr")
        replicas = gateway.replicas
        results: dict[str, httpx.Response | str] = {}

        def stream() -> None:
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=gateway.headers("dr"),
                              json=gateway.body(stream=True, max_tokens=8), timeout=30) as response:
                results["stream_status"] = str(response.status_code)
                results["stream"] = response.read().decode()

        def whole() -> None:
            results["whole"] = httpx.post(f"{gateway.url}/v1/chat/completions", headers=gateway.headers("dr"),
                                          json=gateway.body(max_tokens=8), timeout=30)

        replicas.fault(stall_after=2, calls=1)  # the stream: two tokens, then silence
        streaming = threading.Thread(target=stream)
        streaming.start()
        wait_until(lambda: replicas.total("active") == 1, what="stream running")
        time.sleep(0.3)  # its two tokens are out
        replicas.fault(hold=True, calls=1)  # the other: no message at all
        waiting = threading.Thread(target=whole)
        waiting.start()
        wait_until(lambda: replicas.total("active") == 2, what="both calls running")
        cancelled = replicas.total("cancelled")
        requests_before, tokens_before = gateway.usage("dr")

        gateway.server.server.handle_exit(signal.SIGTERM, None)  # the drain: both still running
        signalled = time.monotonic()
        streaming.join(20)
        waiting.join(20)
        answered_after = time.monotonic() - signalled
        assert not streaming.is_alive() and not waiting.is_alive()
        assert DRAIN_S <= answered_after < DRAIN_S + 5, answered_after

        refused = results["whole"]
        assert isinstance(refused, httpx.Response)
        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"].startswith("req_")
        assert results["stream_status"] == "200"
        events = sse_events(str(results["stream"]))
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert content == " hello hello"
        assert events[-1]["error"]["code"] == "shutting_down"
        assert "data: [DONE]" not in str(results["stream"])
        wait_until(lambda: replicas.total("cancelled") == cancelled + 2, timeout=5, what="engine calls cancelled")

        gateway.server.thread.join(20)  # the server then shut down by itself
        assert not gateway.server.thread.is_alive()
        # usage flushed at shutdown: the stream's two tokens billed, the refused request not
        assert gateway.usage("dr") == (requests_before + 1, tokens_before + 2)
    finally:
        gateway.close()
