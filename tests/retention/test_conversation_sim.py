"""Conversations in traces and in the simulator: the line shapes, the families, ``<policy>+conv`` replay."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from retention.simulation.conversational import ConversationPolicy
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import ResponseDeletion, TraceError, parse_trace, parse_trace_events
from retention.workloads import AGENT_LOOP, families
from retention.workloads.agent import AgentSpec, agent_trace
from retention.workloads.chat import ChatSpec, chat_trace

BS = 16
SMALL_AGENT = AgentSpec(duration_s=120.0, block_size=BS, runs_per_s=0.5, system_blocks=2)


def line(at: float, ids: list[int], **extra) -> str:  # type: ignore[no-untyped-def]
    return json.dumps({"timestamp": at, "input_length": len(ids) * BS, "output_length": 1, "hash_ids": ids, **extra})


def test_trace_lines_carry_the_conversation_and_delete_events() -> None:
    lines = [line(0, [1, 2], response_id="r1", store=True, offers_tools=True),
             json.dumps({"timestamp": 500, "op": "delete_response", "response_id": "r1", "tenant": "a"}),
             line(100, [1, 2, 3], response_id="r2", previous_response_id="r1", store=True)]
    requests, deletions = parse_trace_events(lines, block_size=BS)
    assert [(r.response_id, r.previous_response_id, r.store, r.offers_tools) for r in requests] == [
        ("r1", None, True, True), ("r2", "r1", True, False)]
    assert deletions == [ResponseDeletion(500.0, "r1", "a")]
    assert parse_trace(lines, block_size=BS) == requests  # events are left out of the requests
    plain = parse_trace([line(0, [1])], block_size=BS)[0]
    assert (plain.response_id, plain.previous_response_id, plain.store, plain.offers_tools) == (None, None, False, False)


@pytest.mark.parametrize("bad, field", [
    (json.dumps({"timestamp": 0, "op": "purge", "response_id": "r"}), "unknown op"),
    (json.dumps({"timestamp": 0, "op": "delete_response"}), "needs a response_id"),
    (json.dumps({"timestamp": 0, "op": "delete_response", "response_id": "r", "hash_ids": []}), "unknown fields"),
    (line(0, [1], store="yes"), "store must be a boolean"),
    (line(0, [1], offers_tools=1), "offers_tools must be a boolean"),
    (line(0, [1], response_id=""), "response_id must be a non-empty string"),
    (line(0, [1], response_id="r", previous_response_id="r"), "cannot continue itself"),
])
def test_malformed_conversation_lines_are_refused_by_name(bad: str, field: str) -> None:
    with pytest.raises(TraceError, match=field):
        parse_trace_events([bad], block_size=BS)


def _requests(lines: list[dict]) -> list[dict]:
    keep = ("timestamp", "input_length", "output_length", "hash_ids")
    return [{k: x[k] for k in keep} for x in lines if "op" not in x]


def test_agent_loop_runs_are_responses_chains_over_the_agent_requests() -> None:
    spec = replace(SMALL_AGENT, responses=True, delete_share=0.5)
    lines = agent_trace(spec, seed=3)
    assert lines == agent_trace(spec, seed=3)  # deterministic for (spec, seed)
    assert _requests(lines) == _requests(agent_trace(SMALL_AGENT, seed=3))  # the same requests
    requests, deletions = parse_trace_events([json.dumps(x) for x in lines], block_size=BS)
    seen: dict[str, float] = {}
    for r in requests:
        assert r.store and r.offers_tools and r.response_id not in seen
        if r.previous_response_id is not None:
            assert seen[r.previous_response_id] < r.timestamp_ms
        seen[r.response_id] = r.timestamp_ms
    assert deletions and all(seen[d.response_id] <= d.timestamp_ms for d in deletions)
    runs = {r.response_id.rsplit("-", 1)[0] for r in requests}
    deleted = {d.response_id.rsplit("-", 1)[0] for d in deletions}
    assert 0 < len(deleted) < len(runs)  # some runs deleted, the rest abandoned


def test_chat_turns_continue_stored_responses_without_tools() -> None:
    spec = ChatSpec(duration_s=300.0, block_size=BS, responses=True, delete_share=1.0)
    requests, deletions = parse_trace_events([json.dumps(x) for x in chat_trace(spec, seed=1)], block_size=BS)
    assert all(r.store and not r.offers_tools for r in requests)
    assert any(r.previous_response_id for r in requests)
    assert len(deletions) == len(requests)  # every session deleted, each of its responses
    assert _requests(chat_trace(spec, seed=1)) == _requests(chat_trace(replace(spec, responses=False, delete_share=0.0),
                                                                       seed=1))


def test_the_families_include_agent_loop_and_stored_chat() -> None:
    by_name = {f.name: f for f in families()}
    assert by_name["agent-loop"].role == "report" and AGENT_LOOP.responses
    assert by_name["chat"].role == "tune"


def test_conv_plans_as_its_inner_policy_where_no_conversation_is() -> None:
    lines = [json.dumps(x) for x in agent_trace(SMALL_AGENT, seed=0)]  # no Responses fields
    requests = parse_trace(lines, block_size=BS)
    config = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    plain = simulate(requests, make_policy("lru"), primary_blocks=20, secondary_blocks=0, config=config)
    conv = simulate(requests, make_policy("lru+conv"), primary_blocks=20, secondary_blocks=0, config=config)
    assert conv.policy == "lru+conv" and (conv.hit_tokens, conv.requests) == (plain.hit_tokens, plain.requests)


def test_replay_delivers_deletions_to_the_policy_never_to_the_pool() -> None:
    spec = replace(SMALL_AGENT, responses=True, delete_share=1.0, delete_median_s=0.5)
    requests, deletions = parse_trace_events([json.dumps(x) for x in agent_trace(spec, seed=2)], block_size=BS)
    config = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    delivered = []

    class Watch(ConversationPolicy):
        def on_delete(self, deletion, *, now):  # type: ignore[no-untyped-def]
            assert deletion.timestamp_ms / 1000.0 <= now  # in order, never early
            delivered.append(deletion.response_id)
            ConversationPolicy.on_delete(self, deletion, now=now)

    policy = Watch(make_policy("lru"))
    with_deletes = simulate(requests, policy, primary_blocks=30, secondary_blocks=0, config=config, deletions=deletions)
    last = requests[-1].timestamp_ms
    assert delivered == [d.response_id for d in deletions if d.timestamp_ms <= last]
    assert policy.ledger.deleted == len(delivered) > 0 and policy.held_requests > 0
    # The pool never hears of a deletion: a valid trace continues no deleted response, so the
    # same replay without the deletions serves every request the same.
    without = simulate(requests, make_policy("lru+conv"), primary_blocks=30, secondary_blocks=0, config=config)
    assert without.hit_tokens == with_deletes.hit_tokens
    again = simulate(requests, make_policy("lru+conv"), primary_blocks=30, secondary_blocks=0, config=config,
                     deletions=deletions)
    assert again.hit_tokens == with_deletes.hit_tokens  # deterministic replay
