"""Routing over a pool of real reference engines through real gateways.

Three engines on their own ports share one loaded model; the registry lists them as the
pool's replicas; gateways poll their stats and KV events and route every request. Which
replica served an answer is read from the ``x-kvgate-replica`` response header.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.gateway.fleet import start_fleet

REPLICA = "x-kvgate-replica"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundle):
    built = start_fleet(tmp_path_factory.mktemp("fleet"), bundle, gateways=2)
    yield built
    built.close()


def system(tag: str) -> str:
    return (f"You are the assistant of the {tag} desk. Answer in one short sentence, "
            f"name the {tag} desk in every answer, and never use lists or tables.")


def opening(tag: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system(tag)}, {"role": "user", "content": question}]


def follow_up(messages: list[dict], answer: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_conversation_sticks_to_the_replica_holding_its_prefix(fleet):
    fleet.add_tenant("stick")
    for i in range(3):
        first = opening(f"harbour {i}", f"Which ships dock at pier {i}?")
        r1 = fleet.chat("stick", first)
        assert r1.status_code == 200, r1.text
        served = r1.headers[REPLICA]
        # the replica's KV events reach the gateway's index: the prefix is held there
        assert fleet.wait_indexed(fleet.prompt_hashes("stick", first), 2) == served
        second = follow_up(first, r1.json()["choices"][0]["message"]["content"], "And at the next pier?")
        r2 = fleet.chat("stick", second)
        assert r2.status_code == 200, r2.text
        assert r2.headers[REPLICA] == served
        assert cached(r2) >= 2 * 16


def test_salted_tenants_never_route_by_another_tenants_blocks(fleet):
    fleet.add_tenant("salt-a")
    fleet.add_tenant("salt-b")
    messages = opening("archive", "How old is the oldest map?")
    assert fleet.chat("salt-a", messages).status_code == 200
    hashes_a = fleet.prompt_hashes("salt-a", messages)
    fleet.wait_indexed(hashes_a, 2)
    hashes_b = fleet.prompt_hashes("salt-b", messages)
    assert set(hashes_a).isdisjoint(hashes_b)
    # same text, other salt: no replica's index offers salt-b anything
    assert set(fleet.holders(hashes_b).values()) == {0}
    rb = fleet.chat("salt-b", messages)
    assert rb.status_code == 200 and cached(rb) == 0
    # control: shared tenants (no salt) do follow each other's blocks
    fleet.add_tenant("open-a", isolation="shared")
    fleet.add_tenant("open-b", isolation="shared")
    shared = opening("library", "When does the reading room open?")
    assert fleet.chat("open-a", shared).status_code == 200
    holder = fleet.wait_indexed(fleet.prompt_hashes("open-b", shared), 2)
    rc = fleet.chat("open-b", shared)
    assert rc.headers[REPLICA] == holder and cached(rc) >= 2 * 16


def test_two_gateways_fed_the_same_events_converge(fleet):
    fleet.add_tenant("twins")
    probes = []
    for i in range(3):
        first = opening(f"observatory {i}", f"What can we see from dome {i} tonight?")
        r1 = fleet.chat("twins", first, gateway=0)
        assert r1.status_code == 200
        fleet.wait_indexed(fleet.prompt_hashes("twins", first), 2, gateways=(0, 1))
        second = follow_up(first, r1.json()["choices"][0]["message"]["content"], "And tomorrow?")
        r2 = fleet.chat("twins", second, gateway=1)  # the other gateway
        assert r2.headers[REPLICA] == r1.headers[REPLICA]
        probes += [second, opening(f"observatory {i}", "Is the dome open?"), opening(f"cold {i}", "Hello?")]
    # both gateways hold the same indexes, so, load aside (each gateway's load is its own
    # dispatch history), they choose alike, for warm and cold prompts
    fleet.wait_until(lambda: all(fleet.holders(fleet.prompt_hashes("twins", p), gateway=0)
                                 == fleet.holders(fleet.prompt_hashes("twins", p), gateway=1) for p in probes),
                     what="indexes converged")
    assert ([fleet.decide("twins", p, gateway=0, idle=True) for p in probes]
            == [fleet.decide("twins", p, gateway=1, idle=True) for p in probes])


def test_a_loaded_replica_is_avoided_when_the_cost_says_so(fleet):
    fleet.add_tenant("busy")
    fleet.add_tenant("flood")
    for name in ("r1", "r2"):  # pin the conversation and the load to r0
        fleet.set_state(name, "draining")
        fleet.wait_state(name, "draining")
    first = opening("foundry", "What do we cast today?")
    r1 = fleet.chat("busy", first)
    assert r1.headers[REPLICA] == "r0"
    second = follow_up(first, r1.json()["choices"][0]["message"]["content"], "And tomorrow?")
    prefix = fleet.wait_indexed(fleet.prompt_hashes("busy", second), 2)
    assert prefix == "r0"
    # five generations with long prompts on r0: their prefill work and held blocks put r0
    # beyond the cost's balance band, and the excess outweighs the prefix r0 holds
    r0 = fleet.replica("r0")
    answers: list[httpx.Response] = []
    document = " ".join(f"Chapter {i} tells how the foundry cast bell number {i} in the cold winter." for i in range(20))

    def flood(i: int) -> None:
        answers.append(fleet.chat("flood", [{"role": "user", "content": f"{document} Retell chapter {i} at length."}],
                                  max_tokens=40))

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    fleet.wait_until(lambda: r0.in_flight >= 5, what="load on r0")
    for name in ("r1", "r2"):
        fleet.set_state(name, "active")
        fleet.wait_state(name, "active")
    assert r0.in_flight >= 5, "the load finished before the check; raise max_tokens"
    r2 = fleet.chat("busy", second)
    for t in threads:
        t.join(300)
    assert r2.status_code == 200 and r2.headers[REPLICA] != "r0"
    assert all(a.status_code == 200 and a.headers[REPLICA] == "r0" for a in answers)
    # with the load gone, the longest prefix (now on the replica that served turn 2) wins again
    third = follow_up(second, r2.json()["choices"][0]["message"]["content"], "Thanks.")
    # Race: r0 holds turn 1's full blocks, also leading blocks of `third`: wait for more, i.e. turn 2's replica's events.
    holder = fleet.wait_indexed(fleet.prompt_hashes("busy", third), len(fleet.prompt_hashes("busy", first)) + 1)
    assert holder == r2.headers[REPLICA]
    assert fleet.chat("busy", third).headers[REPLICA] == holder


def test_killing_a_replica_mid_run_fails_no_request_that_had_not_started(tmp_path, bundle):
    fleet = start_fleet(tmp_path, bundle)
    try:
        fleet.add_tenant("kill")
        for name in ("r0", "r2"):  # the first requests all go to r1
            fleet.set_state(name, "disabled")
            fleet.wait_state(name, "disabled")
        r1 = fleet.replica("r1")
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(fleet.chat, "kill", [{"role": "user", "content": f"Count to {i}."}], max_tokens=24)
                       for i in range(12)]
            fleet.wait_until(lambda: r1.in_flight > 0, what="requests on r1")
            for name in ("r0", "r2"):
                fleet.set_state(name, "active")
                fleet.wait_state(name, "active")
            fleet.kill_engine("r1")
            results = [f.result() for f in futures]
        results += [fleet.chat("kill", [{"role": "user", "content": f"Say {w}."}]) for w in ("yes", "no", "maybe")]
        assert [r.status_code for r in results] == [200] * 15, [r.text for r in results if r.status_code != 200]
        assert fleet.metric("kvgate_replica_requests_total", replica="r1", status="retried") >= 1
        assert fleet.metric("kvgate_replica_healthy", replica="r1") == 0
        assert all(r.headers[REPLICA] != "r1" for r in results)
    finally:
        fleet.close()


def test_draining_then_removing_a_replica_fails_no_request(tmp_path, bundle):
    fleet = start_fleet(tmp_path, bundle)
    try:
        fleet.add_tenant("drain")
        fleet.wait_state("r2", "active")
        r2 = fleet.replica("r2")

        def ask(i: int) -> httpx.Response:
            return fleet.chat("drain", [{"role": "user", "content": f"Spell the number {i}."}], max_tokens=24)

        for name in ("r0", "r1"):  # the first requests all go to r2
            fleet.set_state(name, "disabled")
            fleet.wait_state(name, "disabled")
        with ThreadPoolExecutor(4) as pool:
            before = [pool.submit(ask, i) for i in range(8)]
            fleet.wait_until(lambda: r2.in_flight > 0, what="requests on r2")
            for name in ("r0", "r1"):
                fleet.set_state(name, "active")
                fleet.wait_state(name, "active")
            fleet.set_state("r2", "draining")
            fleet.wait_state("r2", "draining")
            during = [pool.submit(ask, i) for i in range(8, 16)]
            before, during = [f.result() for f in before], [f.result() for f in during]
        fleet.wait_until(lambda: r2.in_flight == 0, what="r2 drained")
        fleet.remove("r2")
        fleet.wait_state("r2", None)
        fleet.stop_engine("r2")
        after = [ask(i) for i in range(16, 19)]
        everything = before + during + after
        assert [r.status_code for r in everything] == [200] * 19
        assert any(r.headers[REPLICA] == "r2" for r in before)  # r2 was serving when the drain began
        assert all(r.headers[REPLICA] != "r2" for r in during + after)
        assert fleet.metric("kvgate_replica_requests_total", status="error") == 0
    finally:
        fleet.close()


def test_metrics_carry_the_replica_label(fleet):
    text = httpx.get(f"{fleet.gateways[0].base_url}/metrics", timeout=30).text
    for name in ("r0", "r1", "r2"):
        assert f'kvgate_replica_healthy{{pool="fleet",replica="{name}"}}' in text
    assert 'kvgate_replica_cached_tokens_total{pool="fleet",replica=' in text


def test_replicas_that_each_match_the_registration_raise_no_capacity_mismatch(fleet):
    """Three engines of 256 GPU blocks each behind a pool registered with 256 (per replica):
    no mismatch, although the pool's summed capacity is 768."""
    fleet.wait_until(lambda: fleet.metric("kvgate_pool_blocks", pool="fleet", tier="primary", state="max") == 3 * 256,
                     what="every replica polled")
    assert fleet.metric("kvgate_pool_registered_blocks", pool="fleet", tier="primary") == 256
    assert 'kvgate_pool_capacity_mismatch{pool="fleet"} 0.0' in httpx.get(
        f"{fleet.gateways[0].base_url}/metrics", timeout=30).text
    check = fleet.gateways[0].app.state.gateway.monitor.capacity("fleet")
    assert not check.mismatch and len(check.replicas) == 3 and check.effective_primary == 3 * 256


def test_a_request_hashes_its_prompt_once(fleet, monkeypatch):
    """Planning, the miss-ratio curves and the router share one hashing of the prompt: the
    router routes by the hashes the completion core computed (request_hashes), and still
    routes a follow-up to the replica holding its prefix."""
    from server.gateway.api import completions
    from server.gateway.replicas import routing

    calls: list[str] = []

    def counting(module):
        real = module.block_hashes

        def wrapped(*args, **kwargs):
            calls.append(module.__name__)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(completions, "block_hashes", counting(completions))
    monkeypatch.setattr(routing, "block_hashes", counting(routing))
    fleet.add_tenant("once")
    first = opening("ledger", "How many entries were booked today?")
    r1 = fleet.chat("once", first)
    assert r1.status_code == 200, r1.text
    assert calls == ["server.gateway.api.completions"]
    assert fleet.wait_indexed(fleet.prompt_hashes("once", first), 2) == r1.headers[REPLICA]
    second = follow_up(first, r1.json()["choices"][0]["message"]["content"], "And yesterday?")
    r2 = fleet.chat("once", second)
    assert r2.status_code == 200, r2.text
    assert r2.headers[REPLICA] == r1.headers[REPLICA]
    assert len(calls) == 2
