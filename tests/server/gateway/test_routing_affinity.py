"""``prompt_cache_key`` through a real gateway over two real reference engines.

Requests that share a key but no prefix land on the key's home replica (tenant-salted
rendezvous, ``retention/routing/affinity.py``); two keys with different homes split.
Which replica served is read from the ``x-kvgate-replica`` header. The gateway's cost here is
the default but for an unbounded load band: the band overrules a key when the home's load
leaves it (``tests/retention/test_routing_affinity.py``), and stored conversations' ids, drawn
by the server, can give one replica most of the recent work, so a placement here is affinity's alone.
"""

from __future__ import annotations

import httpx
import pytest

from retention.routing import Candidate, CostModel, affinity_key, home_replica
from server.gateway.replicas.routing import RoutingConfig
from tenants import tenant
from tests.server.gateway.fleet import MODEL, start_fleet

REPLICA = "x-kvgate-replica"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundle):
    routing = RoutingConfig(cost=CostModel(balance_request_share=1e9))
    built = start_fleet(tmp_path_factory.mktemp("affinity"), bundle, replicas_count=2, routing=routing)
    yield built
    built.close()


def chat(fleet, slug: str, word: str, key: str | None) -> httpx.Response:
    # the system text starts with its own word, so no two prompts share a first block
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": f"{word} {word} {word}: answer about {word} in one short sentence."},
        {"role": "user", "content": f"Tell me about {word}."}]}
    if key is not None:
        body["prompt_cache_key"] = key
    return httpx.post(f"{fleet.gateways[0].base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {fleet.keys[slug]}"}, timeout=300)


def homes(fleet, slug: str):  # type: ignore[no-untyped-def]
    """A new tenant's id and its key → home replica name map, once both replicas are in rotation."""
    fleet.add_tenant(slug)
    with fleet.session_factory() as session:
        tenant_id = tenant.get_tenant(session, ref=slug).id
    route = fleet.route()
    fleet.wait_until(lambda: len(route.candidates(set())) == 2, what="two replicas in rotation")
    candidates = [Candidate(c.replica, c.weight) for c in route.candidates(set())]
    names = {r.id: r.name for r in route.replicas.values()}

    def home(key: str) -> str:
        return names[home_replica(affinity_key(f"tenant:{tenant_id}", key), candidates)]
    return tenant_id, home


def test_requests_sharing_a_key_meet_on_its_home_replica(fleet):
    tenant_id, home = homes(fleet, "keyed")

    keys = [f"conversation-{i}" for i in range(64)]
    first = keys[0]
    other = next(k for k in keys if home(k) != home(first))
    words = iter(["harbour", "lantern", "granite", "meadow", "copper", "violet", "thunder", "orchard"])
    served: dict[str, list[str]] = {first: [], other: []}
    for _ in range(3):  # interleaved
        for key in (first, other):
            response = chat(fleet, "keyed", next(words), key)
            assert response.status_code == 200, response.text
            served[key].append(response.headers[REPLICA])
    assert served[first] == [home(first)] * 3
    assert served[other] == [home(other)] * 3
    # the same key in another tenant is another key: its home is drawn independently
    assert affinity_key(f"tenant:{tenant_id}", first) != affinity_key(f"tenant:{tenant_id + 1}", first)


def respond(fleet, slug: str, text: str, previous: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0, "input": text}
    if previous is not None:
        body["previous_response_id"] = previous
    return httpx.post(f"{fleet.gateways[0].base_url}/v1/responses", json=body,
                      headers={"Authorization": f"Bearer {fleet.keys[slug]}"}, timeout=300)


def test_a_stored_conversation_is_routed_by_its_root(fleet):
    """Every turn of a stored Responses conversation (no prompt_cache_key) lands on the home
    replica of its first response's id: the first turn is routed by its own new id, the
    continuations by their chain's root, so conversations spread by id, not by who is idle."""
    _, key_home = homes(fleet, "conversing")

    def home(root: str) -> str:
        return key_home(f"kvgate-conversation:{root}")

    words = ["harbour", "lantern", "granite", "meadow", "copper", "violet"]
    roots: list[str] = []
    served: list[tuple[str, str]] = []  # (root, replica)
    for word in words:  # one conversation per word, its first turns interleaved with the others'
        first = respond(fleet, "conversing", f"{word} {word} {word}: say one thing about {word}.")
        assert first.status_code == 200, first.text
        roots.append(first.json()["id"])
        served.append((roots[-1], first.headers[REPLICA]))
    for root, word in zip(roots, words):
        turn = respond(fleet, "conversing", f"And more about {word}?", previous=root)
        assert turn.status_code == 200, turn.text
        served.append((root, turn.headers[REPLICA]))
    assert [replica for _, replica in served] == [home(root) for root, _ in served]
