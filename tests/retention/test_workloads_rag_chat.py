"""The RAG-chat workload generator: the shape the design notes describe, prefix structure, popularity."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from retention.workloads.rag_chat import RagChatSpec, rag_chat_trace
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import parse_trace


def sessions(lines: list[dict]) -> list[list[dict]]:
    """Group turns by their conversation ids (the first id after system + documents)."""
    groups: dict[int, list[dict]] = {}
    for line in lines:
        groups.setdefault(line["hash_ids"][19], []).append(line)  # 3 system + 16 document ids precede it
    return list(groups.values())


def test_turns_have_the_design_notes_shape_and_extend_each_other() -> None:
    spec = RagChatSpec(duration_s=600, sessions_per_s=0.2)
    lines = rag_chat_trace(spec, seed=3)
    requests = parse_trace([json.dumps(line) for line in lines], block_size=512)  # valid Mooncake lines
    assert len(requests) == len(lines) > 50
    for turns in sessions(lines):
        for t, line in enumerate(turns, start=1):
            # 1,536 system + 8,192 retrieved + (t − 1) × (200 user + 300 answer) + 200 user
            assert line["input_length"] == 1536 + 8192 + (t - 1) * 500 + 200
            assert len(line["hash_ids"]) == -(-line["input_length"] // 512)
            assert line["hash_ids"][:3] == [0, 1, 2]  # the shared system prompt
            assert line["system_tokens"] == 1536 and line["context_tokens"] == line["input_length"] - 200
            assert line["output_length"] == 300
        for earlier, later in zip(turns, turns[1:]):
            assert later["timestamp"] > earlier["timestamp"]
            assert later["hash_ids"][: len(earlier["hash_ids"])] == earlier["hash_ids"]  # a prefix, partial block included


def test_documents_are_shared_blocks_after_the_system_prompt() -> None:
    spec = RagChatSpec(duration_s=2000, sessions_per_s=0.5, corpus_docs=50)
    lines = rag_chat_trace(spec, seed=1)
    for line in lines:
        docs = line["session_docs"]
        assert len(set(docs)) == 4
        expected = [3 + d * 4 + j for d in docs for j in range(4)]  # 4 ids of 512 tokens per 2,048-token document
        assert line["hash_ids"][3:19] == expected
    firsts = Counter(line["session_docs"][0] for line in lines if line["input_length"] == 9928)
    assert firsts.most_common(1)[0][0] == 0  # the most popular document is retrieved first most often


def test_popularity_skew() -> None:
    def draws(skew: float) -> Counter:
        lines = rag_chat_trace(RagChatSpec(duration_s=4000, sessions_per_s=1.0, corpus_docs=200, turns=1,
                                           popularity_skew=skew), seed=5)
        return Counter(d for line in lines for d in line["session_docs"])

    zipf, uniform = draws(1.0), draws(0.0)
    assert zipf[0] > 10 * max(1, zipf[150])  # weights 1 vs 1/151
    assert max(uniform.values()) < 3 * min(uniform[d] for d in range(200))


def test_one_session_replayed_with_unbounded_cache_recomputes_only_new_tokens() -> None:
    lines = rag_chat_trace(RagChatSpec(duration_s=3000, sessions_per_s=0.01), seed=2)
    first = next(turns for turns in sessions(lines) if len(turns) == 6)
    requests = parse_trace([json.dumps(line) for line in first], block_size=512)
    result = simulate(requests, make_policy("lru"), primary_blocks=10_000, secondary_blocks=0,
                      config=SimConfig(tokens_per_block=32, trace_block_size=512))
    lengths = [9928, 10428, 10928, 11428, 11928, 12428]
    # a turn reuses the full 32-token blocks of the previous prompt: floor(L / 32) × 32 tokens
    recomputed = lengths[0] + sum(now - (before // 32) * 32 for before, now in zip(lengths, lengths[1:]))
    assert recomputed == 9928 + 508 + 528 + 516 + 504 + 524
    assert result.prompt_tokens == sum(lengths)
    assert result.recomputed_prefill_tokens == recomputed


@pytest.mark.parametrize("bad", [
    {"system_tokens": 1500}, {"context_tokens": 8000}, {"docs_per_session": 0}, {"corpus_docs": 3},
    {"sessions_per_s": 0}, {"popularity_skew": -1}, {"turns": 0},
])
def test_invalid_specs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        RagChatSpec(**bad)
