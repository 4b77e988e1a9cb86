"""Property tests of the routing core's bookkeeping: load totals and the approximate index's bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from retention.routing import ApproximateIndex, CapacityModel, LoadTracker

ops = st.lists(
    st.tuples(st.sampled_from(["dispatch", "prefill", "complete", "forget"]), st.integers(0, 9), st.integers(0, 2),
              st.integers(0, 500), st.integers(0, 40)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_load_totals_are_the_sums_over_in_flight_requests(steps) -> None:
    tracker = LoadTracker()
    model: dict[int, list] = {}  # request -> [replica, prefill tokens, blocks, prefilling]
    for now, (op, rid, replica, tokens, blocks) in enumerate(steps):
        if op == "dispatch" and rid not in model:
            tracker.dispatch(rid, replica, prefill_tokens=tokens, blocks=blocks, now=float(now))
            model[rid] = [replica, tokens, blocks, True]
        elif op == "prefill":
            tracker.prefill_done(rid)
            if rid in model:
                model[rid][3] = False
        elif op == "complete":
            tracker.complete(rid)
            model.pop(rid, None)
        elif op == "forget":
            tracker.forget_replica(replica)
            model = {r: v for r, v in model.items() if v[0] != replica}
        for r in range(3):
            load = tracker.load(r, now=float(now))
            mine = [v for v in model.values() if v[0] == r]
            assert load.running == len(mine)
            assert load.active_blocks == sum(v[2] for v in mine)
            assert load.queued_prefill_tokens == sum(v[1] for v in mine if v[3])
            assert load.recent_prefill_tokens >= 0
    assert len(tracker) == len(model)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 8), st.integers(0, 8),
    st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), max_size=40),
)
def test_approximate_index_respects_its_capacity_model(primary, secondary, routes) -> None:
    index = ApproximateIndex(CapacityModel(primary, secondary))
    for now, hashes in enumerate(routes):
        index.record(hashes, now=float(now))
        assert len(index._gpu) <= primary and len(index._host) <= secondary
        assert not set(index._gpu) & set(index._host)
        # the most recent route's chain root is always held in the GPU tier
        assert index.match(hashes[:1], now=float(now)).gpu_blocks == 1
