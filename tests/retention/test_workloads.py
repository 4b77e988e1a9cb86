"""Workload families: deterministic per seed, valid Mooncake lines, the structure each promises."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from retention.trace import parse_trace
from retention.workloads import (
    AgentSpec, ApiSpec, ChatSpec, NoisyNeighbourSpec, RagSpec, agent_trace, api_trace, chat_trace, families,
    noisy_neighbour_trace, phased, rag_trace,
)

B = 16
SMALL = {
    "chat": lambda seed: chat_trace(ChatSpec(duration_s=300, block_size=B), seed=seed),
    "rag": lambda seed: rag_trace(RagSpec(duration_s=200, block_size=B, documents=50), seed=seed),
    "agent": lambda seed: agent_trace(AgentSpec(duration_s=300, block_size=B), seed=seed),
    "api": lambda seed: api_trace(ApiSpec(duration_s=100, block_size=B, prompts=20), seed=seed),
    "noisy": lambda seed: noisy_neighbour_trace(NoisyNeighbourSpec(duration_s=60, block_size=B), seed=seed),
}


def parsed(lines: list[dict]):  # noqa: ANN201
    return parse_trace([json.dumps(x) for x in lines], block_size=B)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_generators_are_deterministic_and_parse(name: str) -> None:
    make = SMALL[name]
    lines = make(7)
    assert lines == make(7) and lines != make(8)
    requests = parsed(lines)
    assert len(requests) > 20
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    for r in requests:  # segment boundaries, when given, are inside the prompt
        if r.context_tokens is not None:
            assert (r.system_tokens or 0) <= r.context_tokens < r.input_length


def test_chat_turns_extend_the_previous_prompt() -> None:
    spec = ChatSpec(duration_s=400, block_size=B, turn_choices=(4,), turn_weights=(1.0,), think_median_s=5.0)
    requests = parsed(chat_trace(spec, seed=1))
    by_root: dict[tuple[int, ...], list] = {}
    for r in requests:
        by_root.setdefault(r.hash_ids[: spec.system_blocks + 1], []).append(r)
    sessions = [s for s in by_root.values() if len(s) > 1]
    assert sessions
    for turns in sessions:  # each turn's prompt minus its partial tail prefixes the next turn's
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids and len(nxt.hash_ids) > len(prev.hash_ids)


def test_rag_documents_are_shared_and_popularity_skewed() -> None:
    requests = parsed(rag_trace(RagSpec(duration_s=400, block_size=B, documents=200, follow_up=0.0), seed=2))
    first_doc_block = [r.hash_ids[r.system_tokens // B] for r in requests]
    counts = sorted((first_doc_block.count(h) for h in set(first_doc_block)), reverse=True)
    assert counts[0] >= 5 * counts[len(counts) // 2]  # Zipf: the top document far above the median one


def test_agent_context_grows_every_step() -> None:
    requests = parsed(agent_trace(AgentSpec(duration_s=200, block_size=B, runs_per_s=0.05), seed=3))
    lengths = {}
    for r in requests:
        key = r.hash_ids[: AgentSpec().system_blocks + 1]
        assert len(r.hash_ids) > lengths.get(key, 0)
        lengths[key] = len(r.hash_ids)
    assert max(lengths.values()) >= 15


def test_api_reuse_is_only_the_system_prompts() -> None:
    requests = parsed(api_trace(ApiSpec(duration_s=100, block_size=B, prompts=10), seed=4))
    user_blocks = [h for r in requests for h in r.hash_ids[r.context_tokens // B:]]
    assert len(user_blocks) == len(set(user_blocks))
    assert len({r.hash_ids[: r.context_tokens // B] for r in requests}) <= 10


def test_phased_shifts_time_and_ids_apart() -> None:
    first, second = SMALL["api"](0), SMALL["chat"](0)
    both = phased(first, second, gap_s=2.0)
    end = max(x["timestamp"] for x in first)
    assert both[: len(first)] == first
    later = both[len(first):]
    assert min(x["timestamp"] for x in later) >= end + 2000.0
    assert not {h for x in first for h in x["hash_ids"]} & {h for x in later for h in x["hash_ids"]}
    assert len(parsed(both)) == len(first) + len(second)


def test_families_name_their_roles() -> None:
    fams = families()
    assert len({f.name for f in fams}) == len(fams)
    assert {f.role for f in fams} == {"tune", "report"}
    assert {f.name for f in fams if f.role == "report"} >= {"rag", "agent", "api"}


def test_specs_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        ChatSpec(turn_choices=(1, 2), turn_weights=(1.0,))
    with pytest.raises(ValueError):
        RagSpec(docs_per_query=5, documents=3)
    with pytest.raises(ValueError):
        replace(AgentSpec(), steps=(0, 3))
    with pytest.raises(ValueError):
        ApiSpec(burst=0)
