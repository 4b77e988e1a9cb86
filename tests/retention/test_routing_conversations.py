"""Stored conversations (Responses ``previous_response_id`` chains) are routed by their root, as the gateway routes them."""

from __future__ import annotations

import json

from retention.routing import ConversationRoots, conversation_key
from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig
from retention.trace import parse_trace
from retention.workloads import AgentSpec, agent_trace
from server.gateway.api.responses_convert import conversation_key as gateway_conversation_key


def test_every_turn_of_a_chain_gets_its_roots_key_and_the_clients_key_wins() -> None:
    roots = ConversationRoots()

    def key(response, previous=None, store=True, cache_key=None, tenant="t"):  # noqa: ANN001, ANN202
        return roots.key(tenant, cache_key=cache_key, response_id=response, previous_response_id=previous, store=store)

    assert key("r1") == "kvgate-conversation:r1"  # a new stored conversation is keyed by its own id
    assert key("r2", "r1") == "kvgate-conversation:r1"
    assert key("r3", "r2", store=False) == "kvgate-conversation:r1"  # continues a stored one, is not stored
    assert key("r4", "r2", cache_key="mine") == "mine"  # the client's own grouping wins ...
    assert key("r5", "r4") == "kvgate-conversation:r1"  # ... and the chain keeps its root underneath
    assert key("r6", "r3") == "kvgate-conversation:r3"  # r3 was never stored: the chain as far as seen
    assert key("q1", store=False) is None  # neither stored nor continued: not a conversation
    assert key("q2", "q1") == "kvgate-conversation:q1"
    # response ids are per tenant: another tenant's r2 is another chain
    assert key("r2", tenant="u") == "kvgate-conversation:r2"
    assert key("r7", "r2", tenant="u") == "kvgate-conversation:r2"
    assert key("r8", "r2") == "kvgate-conversation:r1"


def test_the_key_string_is_the_gateways() -> None:
    # one function, not two copies that could drift: the gateway's Responses route keys by it
    assert gateway_conversation_key is conversation_key
    for root in ("resp-1", "resp_abc", None):
        assert conversation_key(root) == (None if root is None else f"kvgate-conversation:{root}")


def agent_loop_lines(duration_s: float = 300.0) -> list[dict]:
    return agent_trace(AgentSpec(duration_s=duration_s, responses=True, delete_share=0.5), seed=5)


def replay(lines: list[dict], router: str, *, conversations: bool, replicas: int = 8):  # noqa: ANN201
    trace = parse_trace([json.dumps(x) for x in lines])
    return simulate_cluster(trace, lambda: make_policy("lru"),
                            cluster=ClusterConfig(replicas, router, conversations=conversations),
                            primary_blocks=400, secondary_blocks=0, config=SimConfig(tokens_per_block=512, hold="tokens"))


def without_client_key(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "prompt_cache_key"} for line in lines]


def test_a_keyless_stored_conversation_routes_as_if_keyed_by_its_root() -> None:
    lines = agent_loop_lines()
    keyless = without_client_key(lines)
    # the same lines, each carrying its chain's root key explicitly (roots followed here, from the lines)
    root_of: dict[str, str] = {}
    explicit = []
    for line in keyless:
        line = dict(line)
        if "hash_ids" in line and "response_id" in line:
            root = root_of.get(line.get("previous_response_id", ""), line["response_id"])
            root_of[line["response_id"]] = root
            line["prompt_cache_key"] = f"kvgate-conversation:{root}"
        explicit.append(line)
    assert len(set(root_of.values())) > 8  # many runs, several turns each
    assert len(set(root_of.values())) < len(root_of)
    for router in ("kv-aware", "session"):
        assert replay(keyless, router, conversations=True).to_dict() == \
            replay(explicit, router, conversations=False).to_dict()


def test_without_the_conversation_rule_a_keyless_run_sticks_to_its_system_prompt_not_to_itself() -> None:
    keyless = without_client_key(agent_loop_lines())
    used = {flag: sum(r.requests > 0 for r in replay(keyless, "session", conversations=flag).replicas)
            for flag in (True, False)}
    # session stickiness by the first block: every run of one agent kind (3 kinds) on one replica;
    # by the conversation's root: the runs spread over all eight
    assert used[False] <= 3
    assert used[True] == 8


def test_a_client_key_on_every_line_makes_the_rule_moot() -> None:
    lines = agent_loop_lines(120.0)
    assert all("prompt_cache_key" in line for line in lines if "hash_ids" in line)
    assert replay(lines, "kv-aware", conversations=True, replicas=4).to_dict() == \
        replay(lines, "kv-aware", conversations=False, replicas=4).to_dict()
