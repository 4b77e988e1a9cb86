"""The load-signal bench judges its candidates by the families grid's own targets and adoption rule."""

from __future__ import annotations

from bench.routing import load_signal
from bench.routing.families import fingerprint

FIRST, SECOND = load_signal.CANDIDATES  # the rows below give every candidate and screen variant the first's figures


def row(family: str, kv: tuple[float, float], cache_only: tuple[float, float], session: tuple[float, float],
        first: tuple[float, float], dynamo: float = 0.3) -> dict:
    out = {"family": family, "ceiling": 0.5}
    figures = {"kv-aware": kv, "cache only": cache_only, "session": session, "random": (0.3, 1.0),
               "round-robin": (0.3, 1.0), "dynamo": (dynamo, 1.0),
               **{label: first for label in (*load_signal.CANDIDATES, *load_signal.SCREEN)}}
    for label, (hit, imbalance) in figures.items():
        out[label] = {"hit": hit, "imbalance": imbalance}
    return out


def test_the_section_counts_losses_to_session_and_judges_by_family() -> None:
    rows = [
        # kv-aware loses to session by 2 points; cache only matches it within 1.3; the candidate loses by 1 point
        row("chat", (0.46, 1.05), (0.48, 1.10), (0.48, 1.10), (0.47, 1.08)),
        # session is behind Dynamo, the best baseline, and still ahead of kv-aware by 2 points: a loss to session;
        # cache only is far behind session there; the candidate meets all three
        row("chat", (0.40, 1.05), (0.30, 1.10), (0.42, 1.10), (0.46, 1.08), dynamo=0.45),
        # kv-aware meets everything; the candidate exceeds 1.3 imbalance
        row("api", (0.47, 1.10), (0.49, 1.60), (0.45, 1.60), (0.48, 1.40)),
        # both meet everything
        row("api", (0.47, 1.10), (0.49, 1.60), (0.45, 1.60), (0.48, 1.20)),
    ]
    body = load_signal.section(rows, {"chat": "tune", "api": "report"}, 1.0)
    assert "falls behind `session` by more than half a point (2 of 4 settings)" in body
    assert "in 1 of these 2 settings: dropping the load term is no answer" in body
    assert "| chat (tune) | 2 | 0 | 1 | 1 |" in body
    assert "| api (report) | 2 | 2 | 1 | 1 |" in body
    # the screen on chat alone: all three, each target's misses, the worst imbalance
    assert "| kv-aware (defaults) | 0 | 1 | 2 | 0 | 1.05 |" in body
    assert f"| (2) {SECOND} | 1 | 0 | 1 | 0 | 1.08 |" in body
    assert "| (1) with a band of ×1.3 | 1 | 0 | 1 | 0 | 1.08 |" in body
    # each target, churn against the defaults (gained / lost), what is left behind session (settings, median points)
    assert "| kv-aware (defaults) | 3 | 2 | 4 | 1.10 | — | 2, 2.0 |" in body
    assert f"| (1) {FIRST} | 4 | 3 | 3 | 1.40 | 1 / 1 | 1, 1.0 |" in body
    assert f"| (2) {SECOND} | 4 | 3 | 3 | 1.40 | 1 / 1 | 1, 1.0 |" in body
    # the tune families alone pick the candidate (one setting, the defaults none); the report families judge it
    assert f"*{FIRST}*, 1 of 2 tune settings meeting all three (defaults 0)" in body
    assert "it meets them in 1 of 2 (defaults 2)" in body
    # it loses one of api's settings, so it stays a variant
    assert "api (2 vs 1)" in body and "it stays a reported variant" in body


def test_the_level_text_names_each_weight_and_the_band() -> None:
    from retention.routing import CostModel

    assert load_signal.level_text(CostModel()) == (
        "1 × queued prefill + 0.1 × decode blocks + 0.2 × recent prefill work against a band of 1 request or ×1.5 the "
        "least-loaded replica's level")
    assert load_signal.level_text(CostModel(queue_weight=0.0, decode_weight=0.0, recent_weight=0.5, balance_rel=1.2)) == (
        "0.5 × recent prefill work against a band of 1 request or ×1.2 the least-loaded replica's level")


def test_every_candidate_is_its_own_replay_and_none_is_the_defaults() -> None:
    tried = {**load_signal.CANDIDATES, **load_signal.SCREEN}
    prints = {fingerprint(label, extra) for label, extra in tried.items()}
    assert len(prints) == len(tried)
    assert fingerprint("kv-aware", ("kv-aware", {}, {})) not in prints


def test_a_candidate_passing_the_rule_is_named_and_not_made_the_default() -> None:
    rows = [row("chat", (0.46, 1.05), (0.48, 1.10), (0.48, 1.10), (0.47, 1.08)),
            row("api", (0.47, 1.10), (0.49, 1.60), (0.45, 1.60), (0.48, 1.20))]
    rows[1][SECOND] = {"hit": 0.40, "imbalance": 1.05}  # the second loses api's one setting: only the first passes
    body = load_signal.section(rows, {"chat": "tune", "api": "report"}, 1.0)
    assert f"Passing the rule, *{FIRST}* is not made the default here" in body
    lose = {"hit": 0.0, "imbalance": 2.0}
    assert load_signal.adopted_note([r | {FIRST: lose, SECOND: lose} for r in rows]) == []  # none passes: no note
