"""Each missed routing target is classified against the placements measured in its setting."""

from __future__ import annotations

from bench.routing.frontier import Point, classify, explained, pareto, points, small, tally
from bench.routing.verdicts import judge, met


def setting(**placements: tuple[float, float]) -> dict:
    """A hand-built setting: ceiling 50 % hit rate (1,000 hit blocks); baselines well below unless given."""
    row = {"ceiling": 0.5, "ceiling_hit_tokens": 1000 * 512, "keyed": True,
           "random": (0.30, 1.05), "round-robin": (0.30, 1.02), "session": (0.38, 1.10), "dynamo": (0.35, 1.05),
           "kv-aware": (0.47, 1.10), "kv-aware, no key": (0.30, 1.10), "cache only": (0.30, 1.10)}
    row.update(placements)
    return {k: {"hit": v[0], "imbalance": v[1]} if isinstance(v, tuple) else v for k, v in row.items()}


def only(row: dict, label: str = "kv-aware"):  # noqa: ANN201
    (v,) = classify(row, label)
    return v


def test_a_setting_meeting_all_three_has_no_verdict_as_the_targets_judge_it() -> None:
    row = setting()
    assert classify(row, "kv-aware") == [] and met(judge(row))


def test_below_ninety_percent_is_infeasible_when_only_an_imbalanced_placement_reaches_it() -> None:
    row = setting(**{"kv-aware": (0.40, 1.10), "cache only": (0.46, 1.50)})
    v = only(row)
    assert (v.target, v.kind) == ("share", "infeasible")
    assert "best within 1.3 kv-aware 80.0 % at 1.10" in v.text and "90 % needs imbalance 1.50 (cache only)" in v.text
    row["cache only"]["hit"] = 0.44  # no placement reaches 90 % at any imbalance
    assert "no placement reaches 90 %" in only(row).text


def test_below_ninety_percent_is_a_shortfall_when_a_placement_reaches_it_within_the_band() -> None:
    v = only(setting(**{"kv-aware": (0.40, 1.10), "cache only": (0.46, 1.25)}))
    assert (v.target, v.kind, v.witness) == ("share", "shortfall", "cache only")


def test_losing_to_a_baseline_only_above_the_imbalance_target_is_a_trade_off() -> None:
    v = only(setting(session=(0.48, 1.40)))
    assert (v.target, v.kind) == ("best", "trade-off")
    assert "session 48.0 % only at 1.40" in v.text and "kv-aware 47.0 % at 1.10" in v.text


def test_losing_to_a_baseline_is_a_shortfall_when_it_wins_within_the_band_or_another_placement_matches_it() -> None:
    assert (only(setting(session=(0.48, 1.20))).kind, only(setting(session=(0.48, 1.20))).witness) == ("shortfall", "session")
    v = only(setting(session=(0.48, 1.40), **{"kv-adaptive": (0.478, 1.20)}))
    assert (v.target, v.kind, v.witness) == ("best", "shortfall", "kv-adaptive")
    # a second baseline beating the router within 1.3 makes it a shortfall though the best is beyond 1.3
    v = only(setting(session=(0.48, 1.40), dynamo=(0.476, 1.05)))
    assert (v.kind, v.witness) == ("shortfall", "dynamo")


def test_a_loss_that_does_not_repeat_on_another_draw_of_the_family_is_within_noise() -> None:
    row = setting(session=(0.48, 1.20))
    row["seeds"] = {"kv-aware": [[1, 0.43, {"session": 0.431}], [2, 0.44, {"session": 0.442}]]}
    v = only(row)
    assert (v.target, v.kind) == ("best", "within noise") and "on seeds 1 and 2" in v.text
    assert explained([v])
    row["seeds"]["kv-aware"][0][1] = 0.41  # lost again on one other draw: a shortfall
    assert only(row).kind == "shortfall"
    # a trade-off stays a trade-off whatever the other draws say
    row = setting(session=(0.48, 1.40))
    row["seeds"] = {"kv-aware": [[1, 0.5, {"session": 0.4}]]}
    assert only(row).kind == "trade-off"


def test_imbalance_is_infeasible_when_no_placement_meeting_the_other_two_stays_within_the_band() -> None:
    v = only(setting(**{"kv-aware": (0.47, 1.40)}, session=(0.46, 1.35)))
    assert (v.target, v.kind) == ("imbalance", "infeasible")
    assert "need imbalance 1.35 (session)" in v.text


def test_imbalance_is_a_shortfall_when_a_placement_meets_all_three() -> None:
    v = only(setting(**{"kv-aware": (0.47, 1.40), "kv-aware, band 2 request, ×2": (0.47, 1.20)}))
    assert (v.target, v.kind, v.witness) == ("imbalance", "shortfall", "kv-aware, band 2 request, ×2")


def test_a_setting_is_explained_only_when_every_missed_target_is() -> None:
    row = setting(**{"kv-aware": (0.40, 1.40), "cache only": (0.46, 1.50)}, session=(0.44, 1.45))
    vs = classify(row, "kv-aware")
    assert [(v.target, v.kind) for v in vs] == [("share", "infeasible"), ("best", "trade-off"), ("imbalance", "infeasible")]
    assert explained(vs)
    row["kv-adaptive"] = {"hit": 0.46, "imbalance": 1.2}  # now meets all three within the band
    assert [v.kind for v in classify(row, "kv-aware")] == ["shortfall"] * 3 and not explained(classify(row, "kv-aware"))
    t = tally([row, setting()], "kv-aware")
    assert (t["missed"], t["explained"], t["shortfall"]) == (1, 0, 1)
    assert t["witnesses"] == {("share", "kv-adaptive"): 1, ("best", "kv-adaptive"): 1, ("imbalance", "kv-adaptive"): 1}


def test_small_ceilings_the_frontier_and_the_unkeyed_diagnostic() -> None:
    assert small(setting()) is None and small(setting(ceiling_hit_tokens=12 * 512)) == 12
    assert pareto([Point("a", 0.4, 1.0), Point("b", 0.3, 1.2), Point("c", 0.5, 1.3), Point("d", 0.5, 1.5)]) == [
        Point("a", 0.4, 1.0), Point("c", 0.5, 1.3)]
    # without a key the no-key diagnostic is kv-aware's own replay, not another placement
    assert "kv-aware, no key" not in {p.label for p in points(setting(keyed=False))}


def test_verdicts_agree_with_the_targets_and_never_call_a_target_infeasible_that_a_placement_meets() -> None:
    import random

    draw = random.Random(0)
    labels = ("random", "round-robin", "session", "dynamo", "kv-aware", "kv-aware, no key", "cache only", "kv-adaptive")
    for _ in range(2000):
        row = setting(**{k: (draw.uniform(0.3, 0.55), draw.uniform(1.0, 1.6)) for k in labels})
        vs = classify(row, "kv-aware")
        assert (vs == []) == met(judge(row))
        pts = [p for p in points(row) if p.imbalance <= 1.3]
        top = max(row[b]["hit"] for b in labels[:4])
        for v in vs:
            if v.kind == "shortfall":
                continue
            if v.target == "share":
                assert all(p.hit < 0.45 for p in pts)
            elif v.target == "best":
                assert all(p.hit < top - 0.005 for p in pts)
            else:
                assert not any(p.hit >= 0.45 and p.hit >= top - 0.005 for p in pts)
