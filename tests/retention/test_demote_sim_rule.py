"""The simulator's ``+conv+demote`` demotes on delete exactly what the gateway would: the same
orphaned leaves, each from the same block (the gateway's own helpers give the expectation)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from retention.policy.demote import MAX_LEAVES, doomed
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import parse_trace_events
from server.gateway.api.conversation_demote import MAX_LEAVES as GATEWAY_MAX_LEAVES, DeletedPrompt
from tenants.responses import ConversationRow

B = 4
SYSTEM_BLOCKS = 2  # blocks 1, 2: the system and tools segment every prompt below starts with
CONFIG = SimConfig(tokens_per_block=B, trace_block_size=B)

#   r1 ─ r2 ─ r4        one conversation (root r1) with a branch: r2 and r3 both continue r1
#    └── r3
#   o1                  another conversation whose prompt replays r4's whole history (no previous_response_id)
PROMPTS = {  # full blocks, chained ids: equal ids at i means the prompts agree up to block i
    "r1": ([1, 2, 10], None),
    "r2": ([1, 2, 10, 11, 12], "r1"),
    "r3": ([1, 2, 10, 21], "r1"),
    "r4": ([1, 2, 10, 11, 12, 13], "r2"),
    "o1": ([1, 2, 10, 11, 12, 13, 14], None),
}
DELETES = ["r4", "r1", "r2"]  # a leaf of the branch, then the branch's parent, then an orphan


class _Recorder:
    """The policy, with every demote it answers a delete with recorded as (leaf, first block)."""

    def __init__(self, policy) -> None:  # noqa: ANN001 - a SimPolicy
        self._policy = policy
        self.sent: list[list[tuple[str, int]]] = []

    def __getattr__(self, name: str):  # noqa: ANN204 - forwards the SimPolicy protocol
        return getattr(self._policy, name)

    def demote_request(self, deletion, **kwargs):  # noqa: ANN001, ANN201
        out = self._policy.demote_request(deletion, **kwargs)
        self.sent.append([(request.response_id, plan.ranges[-1].start // B) for request, plan in out or ()])
        return out


def _trace() -> tuple[list, list]:
    lines = []
    for at, (rid, (ids, prev)) in enumerate(PROMPTS.items()):
        obj = {"timestamp": at * 1000, "input_length": len(ids) * B + 1, "output_length": 1,
               "hash_ids": ids + [900 + at], "response_id": rid, "store": True, "offers_tools": True,
               "system_tokens": SYSTEM_BLOCKS * B}
        if prev:
            obj["previous_response_id"] = prev
        lines.append(json.dumps(obj))
    for at, rid in enumerate(DELETES, start=10):
        lines.append(json.dumps({"timestamp": at * 1000, "op": "delete_response", "response_id": rid}))
    lines.append(json.dumps({"timestamp": 20_000, "input_length": 2 * B, "output_length": 1, "hash_ids": [500, 501]}))
    return parse_trace_events(lines, block_size=B)


def _gateway_demotes() -> list[list[tuple[str, int]]]:
    """What ``doomed_prompts`` + ``Demotes.spawn`` would send per delete, from the store's rows of the
    deleted response's conversation (``conversation_rows``: same root), through the gateway's helpers."""
    root = {"r1": "r1", "r2": "r1", "r3": "r1", "r4": "r1", "o1": "o1"}
    live = dict(PROMPTS)
    out = []
    for deleted in DELETES:
        rows = [ConversationRow(rid, prev, tuple(ids)) for rid, (ids, prev) in live.items()
                if root[rid] == root[deleted]]
        found = doomed(((r.id, r.previous_response_id, r.prompt_blocks) for r in rows), deleted,
                       max_leaves=GATEWAY_MAX_LEAVES)
        sent = []
        for leaf in found.leaves:
            chain, current = [], leaf  # the store's response_chain: every link must be live, else 404
            while current is not None and current in live:
                chain.append(current)
                current = live[current][1]
            if current is not None:
                continue  # _rebuild fails: nothing sent for this leaf
            prompt = DeletedPrompt("m", SimpleNamespace(system_end=SYSTEM_BLOCKS * B), None,
                                   tuple(live[leaf][0]), found)
            start = prompt.start_block(B, None)
            if start is not None:
                sent.append((leaf, start))
        out.append(sent)
        del live[deleted]
    return out


def test_a_delete_in_a_branched_conversation_demotes_what_the_gateway_demotes() -> None:
    requests, deletions = _trace()
    recorder = _Recorder(make_policy("lru+conv+demote", block_size=B))
    result = simulate(requests, recorder, primary_blocks=64, secondary_blocks=0, config=CONFIG, deletions=deletions)
    want = _gateway_demotes()
    assert MAX_LEAVES == GATEWAY_MAX_LEAVES
    # The leaf's own tail (another conversation's replayed history does not protect it), both
    # orphaned leaves of the branch past the system segment, then nothing for a broken chain.
    assert [len(sent) for sent in want] == [1, 2, 0]
    assert recorder.sent == want
    assert result.demote_requests == 3  # each replayed: everything is still cached
