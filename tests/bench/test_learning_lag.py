"""The learning-lag bench's second-half window: counts after the midpoint, the cache of the first half kept."""

from __future__ import annotations

from bench.retention.learning_lag import halves, prefix
from retention.simulation.sim_policies import make_policy
from retention.trace import ResponseDeletion, TraceRequest

A, B = (1, 2, 3), (7, 8, 9)  # 1,100 tokens each: two full 512-token blocks reusable, the third partial


def trace(*prompts: tuple[int, ...]) -> list[TraceRequest]:
    return [TraceRequest(i, 1000.0 * i, 1100, 16, h) for i, h in enumerate(prompts)]


def test_the_prefix_keeps_the_deletions_a_whole_replay_has_delivered_by_the_midpoint() -> None:
    requests = trace(A, B, A, A)
    deletions = [ResponseDeletion(t, f"r{t:g}") for t in (500.0, 1000.0, 1500.0, 2500.0)]
    head, gone = prefix(requests, deletions, 2000.0)
    assert [r.index for r in head] == [0, 1]
    assert [d.timestamp_ms for d in gone] == [500.0, 1000.0]  # 1500 is delivered only before the request at 2000


def test_the_second_half_counts_hits_on_blocks_cached_in_the_first() -> None:
    # A, B | A, A with room for everything: A's second and third requests hit two blocks each. The second half
    # alone replayed cold would find one hit (1,024 of 2,200 tokens); differenced from the whole run, two.
    whole, second, _ = halves(trace(A, B, A, A), [], 2000.0, lambda: make_policy("lru"), 64, 0)
    assert whole == 2 * 1024 / 4400
    assert second == 2 * 1024 / 2200
