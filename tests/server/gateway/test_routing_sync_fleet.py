"""Routing sync end to end: two real gateways over HTTP, real reference engines, real Redis.

A request held on its replica through gateway 0 is in gateway 1's load and pending blocks
(gateway 1 never saw it: it learns it from gateway 0's notices), and leaves both when it ends.
"""

from __future__ import annotations

import secrets
import threading

import httpx
import pytest

from tests.server.gateway.fleet import start_fleet

REPLICA = "x-kvgate-replica"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundle):
    built = start_fleet(tmp_path_factory.mktemp("synced"), bundle, replicas_count=2, gateways=2,
                        settings={"routing_sync": True, "redis_url": "redis://127.0.0.1:6379/0",
                                  "redis_namespace": f"test-{secrets.token_hex(4)}"})
    yield built
    built.close()


def test_a_peers_request_in_flight_is_in_this_gateways_load_and_pending_blocks(fleet):
    fleet.add_tenant("relay")
    messages = [{"role": "system", "content": "You are the relay desk. Answer in one short sentence."},
                {"role": "user", "content": "Which relay station is closest to the northern ridge tonight?"}]
    hashes = fleet.prompt_hashes("relay", messages)
    assert len(hashes) >= 2
    for name in ("r0", "r1"):
        fleet.wait_state(name, "active", gateway=1)
        fleet.hang(name, hold_ms=4000)  # the first token waits: the request stays in flight
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(fleet.chat("relay", messages, gateway=0)))
    sender.start()
    try:
        route = fleet.route(1)
        ids = {r.name: r.id for r in route.replicas.values()}

        def running() -> dict[str, int]:
            return {name: route.router.loads.load(rid).running for name, rid in ids.items()}

        fleet.wait_until(lambda: sum(running().values()) == 1, timeout=10, what="gateway 0's dispatch at gateway 1")
        target = next(name for name, n in running().items() if n == 1)
        assert route.peers is not None and route.peers.in_flight() == 1
        pending = {name: route.router.match(rid, hashes, now=0.0).pending_blocks for name, rid in ids.items()}
        assert pending[target] == len(hashes) and sum(pending.values()) == len(hashes)
        # a twin of the prompt through gateway 1 now would join it there, where its blocks are being computed
        assert fleet.decide("relay", messages, gateway=1) == target
    finally:
        for name in ("r0", "r1"):
            fleet.hang(name, hold_ms=0)
        sender.join(120)
    assert answer and answer[0].status_code == 200 and answer[0].headers[REPLICA] == target
    fleet.wait_until(lambda: sum(running().values()) == 0 and route.peers.in_flight() == 0, timeout=10,
                     what="the completion at gateway 1")
    assert route.router.match(ids[target], hashes, now=0.0).pending_blocks == 0
    # /metrics: each gateway hears the other; gateway 1 received gateway 0's three notices at least
    assert fleet.metric("kvgate_routing_sync_peers", gateway=1, pool="fleet") == 1.0
    assert fleet.metric("kvgate_routing_sync_peer_requests", gateway=1, pool="fleet") == 0.0
    assert fleet.metric("kvgate_routing_sync_notices_total", gateway=1, outcome="received") >= 3
    assert fleet.metric("kvgate_routing_sync_notices_total", gateway=0, outcome="dropped") == 0.0
    # a router switch starts the peers' load over on the new router
    routing = fleet.gateways[1].app.state.gateway.routing
    routing.use_router("kv-aware")
    assert route.peers.router is route.router and route.peers.in_flight() == 0
