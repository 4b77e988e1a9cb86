"""``protect``: conversations from chained hashes, admission under the GPU capacity, the plan's bands."""

from __future__ import annotations

import json

import pytest

from retention.policy.protect import ConversationTracker, ProtectConfig, ProtectPolicy, protect_plan, protect_priorities
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import parse_trace
from retention.workloads import ChatSpec, chat_trace

B = 16
SYSTEM = [101, 102, 103]


def turn(conversation: int, turns: int) -> list[int]:
    """Full-block hashes of a conversation's turn: the shared system prompt, then 2 private blocks per turn."""
    return SYSTEM + [1000 * conversation + k for k in range(2 * turns)]


def test_a_conversation_is_keyed_past_the_shared_prefix_and_stable_across_turns() -> None:
    tracker = ConversationTracker(100)
    tracker.observe(turn(1, 1), 0.0, num_blocks=6)
    assert tracker.split(turn(1, 2)) == (0, SYSTEM[0])  # nothing shared seen yet: one chain
    assert tracker.split(turn(2, 1)) == (3, 2000)  # a second child of the system prompt: shared from here on
    tracker.observe(turn(2, 1), 1.0, num_blocks=6)
    assert tracker.split(turn(1, 3)) == (3, 1000)
    tracker.observe(turn(1, 3), 2.0, num_blocks=10)
    assert tracker.split(turn(1, 4)) == (3, 1000) and tracker.split(turn(2, 5)) == (3, 2000)
    assert tracker.split(SYSTEM) == (3, None)  # only shared blocks: no conversation


def test_admission_keeps_the_live_protected_footprint_within_the_share() -> None:
    tracker = ConversationTracker(20, ProtectConfig(share=0.75, min_live_s=1_000.0, max_live_s=1_000.0))
    admitted = []
    for c in range(1, 8):
        hashes = turn(c, 2)
        start, key = tracker.split(hashes)
        admitted.append(tracker.protected(key, len(hashes) - start, float(c)))
        tracker.observe(hashes, float(c), num_blocks=len(hashes))
        assert tracker.footprint <= 0.75 * 20
    # The first conversation is one chain of 7 blocks (nothing shared seen yet), the others
    # 4 private blocks each: 7 + 4 + 4 = 15 fills the share.
    assert admitted == [True, True, True, False, False, False, False]
    # A live protected conversation stays protected as it grows past the share ...
    grown = turn(2, 6)
    start, key = tracker.split(grown)
    assert tracker.protected(key, len(grown) - start, 8.0)
    # ... and once every conversation went quiet, the room is free again.
    assert tracker.protected(tracker.split(turn(9, 2))[1], 4, 5_000.0)


def test_plan_puts_the_shared_prefix_and_protected_blocks_above_the_rest() -> None:
    high, low = protect_priorities(30)
    assert (high, low) == (45, 35) and protect_priorities(60) == (61, 35)
    tracker = ConversationTracker(8, ProtectConfig(share=0.5))
    tracker.observe(turn(1, 1), 0.0, num_blocks=6)
    tracker.observe(turn(2, 1), 0.1, num_blocks=6)  # 3 private blocks: admitted under the share of 4
    # (the first conversation, one 6-block chain then, did not fit)
    plan = protect_plan(tracker, turn(3, 1), num_tokens=6 * B - 3, tokens_per_block=B, now=0.2, offload_min_priority=30)
    priorities = [plan.retention_at(i * B)[0] for i in range(6)]
    assert priorities == [high] * 3 + [low] * 3  # shared prefix high, a conversation that does not fit low
    assert all(a >= b for a, b in zip(priorities, priorities[1:]))  # never increasing along the chain
    assert plan.retention_at(0)[1] == int(tracker.live_s() * 1000)  # the band lasts the live window
    assert plan.retention_at(5 * B)[1] is None


def test_memory_is_bounded() -> None:
    tracker = ConversationTracker(50, ProtectConfig(max_blocks=40, max_conversations=5))
    for c in range(1, 60):
        tracker.observe(turn(c, 3), float(c), num_blocks=9)
    assert len(tracker._nodes) <= 40 and len(tracker._conversations) <= 5
    assert tracker.footprint == sum(conv.blocks for conv in tracker._live.values()) >= 0


def test_protect_beats_lru_where_the_live_conversations_overflow_the_pool() -> None:
    requests = parse_trace([json.dumps(x) for x in chat_trace(ChatSpec(duration_s=600, block_size=B), seed=0)],
                           block_size=B)
    config = SimConfig(tokens_per_block=B, trace_block_size=B)
    lru = simulate(requests, make_policy("lru"), primary_blocks=30, secondary_blocks=0, config=config)
    policy = make_policy("protect")
    assert isinstance(policy, ProtectPolicy)
    protected = simulate(requests, policy, primary_blocks=30, secondary_blocks=0, config=config)
    assert protected.hit_rate > 1.1 * lru.hit_rate


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        ProtectConfig(share=0.0)
    with pytest.raises(ValueError):
        ProtectConfig(min_live_s=10.0, max_live_s=1.0)


def test_memory_caps_scale_with_the_pool_unless_set() -> None:
    assert ProtectConfig().caps(100) == (4_096, 1_024)
    assert ProtectConfig().caps(10_000) == (80_000, 20_000)
    assert ProtectConfig().caps(1_000_000) == (400_000, 100_000)
    assert ProtectConfig(max_blocks=7, max_conversations=3).caps(10_000) == (7, 3)
    with pytest.raises(ValueError):
        ProtectConfig(max_blocks=0)
