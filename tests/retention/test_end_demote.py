"""A tool loop's run that ends in a message: the output kind in the trace, and the completion-time demote."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from retention.policy.demote import DemoteLedger, end_start
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import TraceError, parse_trace_events
from retention.workloads.agent import AgentSpec, agent_trace

BS = 16
SPEC = AgentSpec(duration_s=600.0, block_size=BS, runs_per_s=0.3, system_blocks=2, responses=True)


def test_each_run_step_says_whether_it_called_a_tool_or_answered() -> None:
    requests, _ = parse_trace_events([json.dumps(x) for x in agent_trace(SPEC, seed=1)], block_size=BS)
    runs: dict[str, list] = {}
    for r in requests:
        runs.setdefault(r.response_id.rsplit("-", 1)[0], []).append(r)
    assert all(r.output_kind in ("tool_call", "message") for r in requests)
    ended = [steps for steps in runs.values() if steps[-1].timestamp_ms < 500_000]  # runs not cut by the trace's end
    assert ended and all(steps[-1].output_kind == "message" for steps in ended)
    assert sum(r.output_kind == "message" for r in requests) > len(ended)  # some steps ask a human, and the run goes on
    plain = agent_trace(replace(SPEC, responses=False), seed=1)
    assert all("output_kind" not in line for line in plain)


def test_a_bad_output_kind_is_refused_by_name() -> None:
    bad = json.dumps({"timestamp": 0, "input_length": BS, "output_length": 1, "hash_ids": [1], "output_kind": "done"})
    with pytest.raises(TraceError, match="output_kind"):
        parse_trace_events([bad], block_size=BS)


def test_chain_start_skips_blocks_other_conversations_hold_not_the_runs_own() -> None:
    ledger = DemoteLedger()
    ledger.stored("t", "a1", [1, 2, 3])
    ledger.stored("t", "a2", [1, 2, 3, 4, 5])  # the same run, a step later
    ledger.stored("t", "b1", [1, 9])  # another conversation sharing block 1 (the system prompt)
    assert ledger.chain_start("t", "a2", ["a1", "a2"]) == 1
    assert ledger.chain_start("t", "a2", []) == 3  # without its chain, its earlier step's blocks look shared
    assert ledger.chain_start("t", "b1", ["b1"]) == 1 and ledger.chain_start("t", "zz", ["zz"]) is None
    assert ledger.live("t") == 3  # nothing is forgotten: the run's responses stay stored


def test_an_ended_runs_own_blocks_are_demoted_at_completion_and_that_pays_on_a_tight_pool() -> None:
    requests, deletions = parse_trace_events([json.dumps(x) for x in agent_trace(SPEC, seed=1)], block_size=BS)
    config = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    ungated = make_policy("lru+conv+end")
    ungated.end_demote = "always"  # every run ending in a message, whatever the duel says
    results = {}
    for name, policy in (("lru", make_policy("lru")), ("end", ungated)):
        results[name] = simulate(requests, policy, primary_blocks=40, secondary_blocks=0, config=config,
                                 deletions=deletions)
    ended = sum(r.output_kind == "message" for r in requests)
    assert 0 < ungated.end_demotes <= ended and results["end"].demote_requests > 0
    assert results["end"].hit_rate > results["lru"].hit_rate
    again = simulate(requests, make_policy("lru+conv+end"), primary_blocks=40, secondary_blocks=0, config=config,
                     deletions=deletions)
    assert again.hit_tokens == simulate(requests, make_policy("lru+conv+end"), primary_blocks=40, secondary_blocks=0,
                                        config=config, deletions=deletions).hit_tokens  # deterministic


def test_end_start_from_the_stored_rows_skips_other_conversations_not_the_runs_own() -> None:
    rows = [("a", (1, 2, 3)), ("a", (1, 2, 3, 4, 5)), ("b", (1, 9))]  # a's run (two steps) and b sharing block 1
    assert end_start((1, 2, 3, 4, 5), rows, "a") == 1  # the run's own earlier step protects nothing
    assert end_start((1, 2, 3, 4, 5), [*rows, ("c", (1, 2, 3, 7))], "a") == 3  # another conversation shares 3 blocks
    assert end_start((1, 2, 3, 4, 5), [*rows, ("c", (1, 2, 3, 4, 5))], "a") is None  # all of it held elsewhere
    assert end_start((1, 2, 3, 4, 5), rows, "a", protected_blocks=2) == 2  # the system segment: never demoted
    assert end_start((1, 2, 3, 4, 5), [("c", None)], "a") == 0  # unknown blocks: the protected segment only
    assert end_start((1, 2), [], "a", protected_blocks=2) is None


def test_end_start_agrees_with_the_ledgers_chain_start_on_random_conversations() -> None:
    rng = random.Random(3)
    for _ in range(200):
        ledger, rows = DemoteLedger(), []
        for i in range(rng.randint(1, 8)):
            root = f"r{rng.randint(0, 3)}"
            prompt = tuple(rng.choice((1, 2)) * 10 + j for j in range(rng.randint(1, 6)))  # two prefix families
            chained = tuple(hash(prompt[:k + 1]) for k in range(len(prompt)))
            ledger.stored("t", f"{root}/{i}", chained)
            rows.append((root, f"{root}/{i}", chained))
        root, rid, prompt = rng.choice(rows)
        chain = [r for owner, r, _ in rows if owner == root]
        assert end_start(prompt, [(o, h) for o, _, h in rows], root) == ledger.chain_start("t", rid, chain)


class _Spy:
    """A simulator policy as is, noting the requests whose completion it answered with a demote."""

    def __init__(self, policy) -> None:  # noqa: ANN001 - a SimPolicy
        self.policy, self.demoted = policy, []

    def __getattr__(self, name: str):  # noqa: ANN204 - delegation
        return getattr(self.policy, name)

    def completion_demote(self, request, **kwargs):  # noqa: ANN001, ANN201 - the SimPolicy hook
        out = self.policy.completion_demote(request, **kwargs)
        if out is not None:
            self.demoted.append(request)
        return out


@pytest.mark.parametrize("base", ["lru", "protect", "adaptive"])
def test_end_alone_plans_as_its_base_where_no_responses_fields_are(base: str) -> None:
    plain_spec = replace(SPEC, duration_s=200.0, responses=False)
    requests, deletions = parse_trace_events([json.dumps(x) for x in agent_trace(plain_spec, seed=1)], block_size=BS)
    config = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    plain = simulate(requests, make_policy(base), primary_blocks=40, secondary_blocks=0, config=config)
    policy = make_policy(base + "+end")
    ended = simulate(requests, policy, primary_blocks=40, secondary_blocks=0, config=config, deletions=deletions)
    assert ended.policy == base + "+end" and policy.end_demotes == 0 and ended.demote_requests == 0
    assert (ended.hit_tokens, ended.requests) == (plain.hit_tokens, plain.requests)


def test_end_alone_demotes_only_runs_answered_with_a_message_and_never_holds() -> None:
    requests, deletions = parse_trace_events([json.dumps(x) for x in agent_trace(SPEC, seed=1)], block_size=BS)
    config = SimConfig(tokens_per_block=BS, trace_block_size=BS)
    spy = _Spy(make_policy("lru+end"))
    result = simulate(requests, spy, primary_blocks=40, secondary_blocks=0, config=config, deletions=deletions)
    assert spy.demoted and all(r.offers_tools and r.output_kind == "message" for r in spy.demoted)
    replayed = result.demote_requests + result.demote_skipped + result.demote_uncached
    assert len(spy.demoted) == spy.end_demotes == replayed
    assert spy.held_requests == 0 and spy.ledger.duel is None  # the base's plans go out unchanged: no hold, no duel
    plain = simulate(requests, make_policy("lru"), primary_blocks=40, secondary_blocks=0, config=config)
    assert result.hit_rate > plain.hit_rate  # the tight pool of the +conv+end test above: the demote alone pays too
