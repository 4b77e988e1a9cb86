"""Routing: which load the balance band bounds — how kv-aware's cost defaults were chosen.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/routing/load_signal.py [--no-write] [--workers 2]
[--cache FILE]``

Writes the ``bench:routing_load_signal`` section of docs/benchmarks.md. Deterministic: the grid of
``bench/routing/families.py`` (every generated family drawn with seed 0, the synthetic trace fixed, each
cut to its first ``families.REQUESTS`` requests), replayed with its own code (``families.replay``,
``families.replay_extras``) and judged by its own rule (``verdicts.judge``, ``families.adoption``).
``--cache`` is the grid's own cache (the same file ``families.py --cache`` writes, and its
``.extras.jsonl``), so either bench reuses the other's replays.

Why this bench. Over the grid, every setting where kv-aware's *previous* defaults fell behind the best
baseline lost to ``session``, at a median imbalance of 1.08 against session's 1.20. The grid's *cache
only* diagnostic (kv-aware with no load term) says the cost's cache terms are not what loses: where the
previous defaults lose to session, cache only reaches session's hit rate (medians, in the section) but
at an imbalance far above 1.3, so a load term is needed, and the question is which load. The previous
defaults bounded one level per replica, ``queued prefill + 0.1 × decode blocks + 0.2 × recent prefill``
(``families.PREVIOUS_KNOBS``), queued prefill at the largest weight: once the level of the replica
holding a conversation's prefix exceeded the band (one request's blocks over the least-loaded level, or
×1.5 that level, whichever is larger) by more than the blocks its hits save, the next turn went
elsewhere, though the imbalance target (max / mean prefill tokens *over the trace*) never sees a passing
queue, and the prefix was then computed twice. The first candidate bounds the replica's *recent* prefill
work alone (tokens dispatched to it, decayed with a 60 s half-life, which counts what is queued from the
moment it is dispatched): ``decode_weight`` 0, ``queue_weight`` 0, that work weighted ``recent_weight``
and a tighter relative band (``balance_rel``), so that only lasting imbalance moves a request off its
cache. When the defaults were chosen (in replays where a prompt became reusable only when its request
ended, before the simulators stored its blocks at the end of its prefill, as TensorRT-LLM does) it lost
settings on chat, a tune family (a passing queue is what keeps its conversations from piling onto one
replica), so a second one came from a screen on chat alone (``SCREEN``: one knob of the
first changed at a time, and the previous defaults with a larger home credit, replayed on chat only): the
first with a quarter of the queued prefill back in its level. It meets the targets in at least as many
settings as the previous defaults in every family, so it is kv-aware's defaults (``retention/routing/cost.py``).
The section says whether the first candidate still loses chat under the corrected store rule (``screen_premise``).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, publish, seed_line  # noqa: E402
from bench.routing import families, tables  # noqa: E402
from bench.routing.verdicts import judge, met, pct  # noqa: E402
from retention.routing import CostModel, make_router  # noqa: E402

# the recent prefill's half-life: the grid's routers are built by make_router with its default
HALF_LIFE_S = inspect.signature(make_router).parameters["half_life_s"].default
RECENT_ONLY = {"queue_weight": 0.0, "decode_weight": 0.0}
# The first candidate's knobs: kv-aware's band over recent prefill work alone (the module docstring).
FIRST_KNOBS = {**RECENT_ONLY, "recent_weight": 0.5, "balance_rel": 1.2}
# Each candidate beside the defaults (the screen's pick): kv-aware with these cost knobs (retention/routing/cost.py).
PREVIOUS = "previous defaults"
FIRST = "recent work ×0.5, band 1 request / ×1.2"
CANDIDATES = {
    PREVIOUS: ("kv-aware", families.PREVIOUS_KNOBS, {}),
    FIRST: ("kv-aware", FIRST_KNOBS, {}),
}
# The second candidate's screen: variants of the first (and one of the previous defaults), each replayed on one tune
# family alone, the one where the first meets the targets in fewer settings than the previous defaults. The second
# candidate, the first with a quarter of the queued prefill back in its level, is the defaults.
SCREEN_FAMILY = "chat"
SCREEN = {
    "(2) with decode blocks ×0.1": ("kv-aware", {**FIRST_KNOBS, "decode_weight": 0.1}, {}),
    "(2) with recent work ×1": ("kv-aware", {**FIRST_KNOBS, "recent_weight": 1.0}, {}),
    "(2) with a band of ×1.1": ("kv-aware", {**FIRST_KNOBS, "balance_rel": 1.1}, {}),
    "(2) with a band of ×1.3": ("kv-aware", {**FIRST_KNOBS, "balance_rel": 1.3}, {}),
    "(2) with a home credit of 4 blocks": ("kv-aware", {**FIRST_KNOBS, "affinity_credit": 4.0}, {}),
    "(1) with a home credit of 4 blocks": ("kv-aware", {**families.PREVIOUS_KNOBS, "affinity_credit": 4.0}, {}),
}


def grid_text() -> str:
    """The grid's axes, from the families bench's own constants."""
    return (f"{'/'.join(map(str, families.REPLICAS))} replicas × {'/'.join(f'{100 * s:g}' for s in families.SHARES)} % "
            f"GPU × host {'/'.join(map(str, families.HOSTS))}× × arrival rate ×{'/×'.join(map(str, families.RATES))}")


def level_text(cost: CostModel) -> str:
    """The load level a cost bounds, from its weights (``cost.py``)."""
    queue = cost.overlap_weight if cost.queue_weight is None else cost.queue_weight
    terms = [(queue, "queued prefill"), (cost.decode_weight, "decode blocks"), (cost.recent_weight, "recent prefill work")]
    level = " + ".join(f"{w:g} × {name}" for w, name in terms if w)
    return (f"{level} against a band of {cost.balance_request_share:g} request or ×{cost.balance_rel:g} the "
            "least-loaded replica's level")


def losses_to_session(rows: list[dict], label: str) -> list[dict]:
    """The settings where ``label`` falls behind ``session`` by more than half a point (the grid's tie)."""
    return [r for r in rows if r[label]["hit"] < r["session"]["hit"] - 0.005]


def diagnosis(rows: list[dict]) -> list[str]:
    """Where the previous defaults lose to session: they, cache only, session and today's defaults side by side."""
    lost = losses_to_session(rows, PREVIOUS)
    if not lost:
        return ["The previous defaults fall behind `session` in no setting."]

    def med(label: str, field: str) -> float:
        return statistics.median(r[label][field] for r in lost)

    within = sum(r["cache only"]["hit"] >= r["session"]["hit"] - 0.005 and r["cache only"]["imbalance"] <= 1.3
                 for r in lost)
    return [
        f"Where the previous defaults fall behind `session` by more than half a point ({len(lost)} of {len(rows)} "
        "settings), medians:",
        "",
        "| placement | hit rate | load imbalance |",
        "|---|---:|---:|",
        *(f"| {name} | {pct(med(label, 'hit'))} % | {med(label, 'imbalance'):.2f} |"
          for label, name in ((PREVIOUS, PREVIOUS), ("cache only", "cache only"), ("session", "session"),
                              ("kv-aware", "kv-aware (defaults)"))),
        "",
        f"Cache only (no load term) reaches session's hit rate (within half a point) at imbalance ≤ 1.3 in {within} "
        f"of these {len(lost)} settings"
        + (": mostly the load term costs the hits, and without it the pool stays balanced." if 2 * within > len(lost)
           else ": dropping the load term is no answer (it buys the hits with imbalance), so the question is which "
                "load the band should bound."),
    ]


def family_table(rows: list[dict], roles: dict[str, str], labels: list[str]) -> list[str]:
    """Settings meeting all three targets, per family, for every label."""
    fams = list(dict.fromkeys(r["family"] for r in rows))
    head = ["kv-aware (defaults)", *(f"({i})" for i in range(1, len(labels)))]
    lines = ["| family (role) | settings | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(labels)]
    for f in fams:
        mine = [r for r in rows if r["family"] == f]
        lines.append(f"| {f} ({roles[f]}) | {len(mine)} | "
                     + " | ".join(str(sum(met(judge(r, label)) for r in mine)) for label in labels) + " |")
    return lines


def target_table(rows: list[dict], labels: list[str]) -> list[str]:
    """Each target on its own, the churn against the defaults, and what is left of the losses to session."""
    lines = ["| router | ≥ 90 % of ceiling | ≥ best baseline | imbalance ≤ 1.3 | worst imbalance | gained / lost vs "
             "defaults | behind session: settings, median points |", "|---|---:|---:|---:|---:|---:|---:|"]
    for i, label in enumerate(labels):
        js = [judge(r, label) for r in rows]
        lost = losses_to_session(rows, label)
        gap = f"{statistics.median(100 * (r['session']['hit'] - r[label]['hit']) for r in lost):.1f}" if lost else "—"
        churn = "—" if label == "kv-aware" else (
            f"{sum(met(judge(r, label)) and not met(judge(r)) for r in rows)} / "
            f"{sum(met(judge(r)) and not met(judge(r, label)) for r in rows)}")
        name = "kv-aware (defaults)" if label == "kv-aware" else f"({i}) {label}"
        lines.append(f"| {name} | {sum(j['ok_share'] for j in js)} | {sum(j['ok_best'] for j in js)} | "
                     f"{sum(j['ok_imbalance'] for j in js)} | {max(r[label]['imbalance'] for r in rows):.2f} | {churn} | "
                     f"{len(lost)}, {gap} |")
    return lines


def screen_table(rows: list[dict]) -> list[str]:
    """The screen on ``SCREEN_FAMILY`` alone: each target's misses and the settings meeting all three, per variant."""
    mine = [r for r in rows if r["family"] == SCREEN_FAMILY]
    names = {"kv-aware": "kv-aware (defaults)", **{label: f"({i}) {label}" for i, label in enumerate(CANDIDATES, 1)}}
    lines = [f"| variant ({SCREEN_FAMILY}, {len(mine)} settings) | all three | ≥ 90 % of ceiling missed | ≥ best "
             "baseline missed | imbalance above 1.3 | worst imbalance |", "|---|---:|---:|---:|---:|---:|"]
    for label in ["kv-aware", *CANDIDATES, *SCREEN]:
        js = [judge(r, label) for r in mine]
        lines.append(f"| {names.get(label, label)} | {sum(map(met, js))} | {sum(not j['ok_share'] for j in js)} | "
                     f"{sum(not j['ok_best'] for j in js)} | {sum(not j['ok_imbalance'] for j in js)} | "
                     f"{max(r[label]['imbalance'] for r in mine):.2f} |")
    return lines


def screen_premise(rows: list[dict]) -> str:
    """Whether the first candidate still meets the targets in fewer ``SCREEN_FAMILY`` settings than the defaults in
    these replays (the premise the screen was made on), counted from the rows."""
    mine = [r for r in rows if r["family"] == SCREEN_FAMILY]
    first, defaults = count(mine, FIRST), count(mine, "kv-aware")
    text = f"In these replays (2) meets all three targets in {first} {SCREEN_FAMILY} settings, the defaults in {defaults}"
    if first > defaults:
        return text + (": the screen's premise no longer holds, and the tune families alone would now pick (2) (below); "
                       "the adoption rule judges it on every family.")
    return text + "."


def count(subset: list[dict], label: str) -> int:
    """Settings of ``subset`` where ``label`` meets all three targets."""
    return sum(met(judge(r, label)) for r in subset)


def pick(rows: list[dict], roles: dict[str, str]) -> list[str]:
    """What the tune families alone pick among the defaults and the candidates, and how the held-out families judge it."""
    tune = [r for r in rows if roles[r["family"]] == "tune"]
    report = [r for r in rows if roles[r["family"]] == "report"]
    labels = ["kv-aware", *CANDIDATES]
    names = {"kv-aware": "the defaults", PREVIOUS: "the previous defaults", FIRST: "the first candidate"}
    best = max(labels, key=lambda label: count(tune, label))  # first listed wins a tie
    others = [label for label in labels if label != best]
    return [f"Picked on the tune families alone: {names[best]}, {count(tune, best)} of {len(tune)} tune settings "
            "meeting all three (" + ", ".join(f"{names[label]} {count(tune, label)}" for label in others) + "); on "
            f"the held-out report families {count(report, best)} of {len(report)} ("
            + ", ".join(f"{names[label]} {count(report, label)}" for label in others) + ")."]


def adopted(rows: list[dict], roles: dict[str, str]) -> str:
    """The rule a default follows, applied to the defaults against the previous ones: at least their count of
    settings meeting all three targets in every family (counted from the rows)."""
    fams = list(dict.fromkeys(r["family"] for r in rows))
    per = {f: (count([r for r in rows if r["family"] == f], PREVIOUS),
               count([r for r in rows if r["family"] == f], "kv-aware")) for f in fams}
    fewer = [f"{f} ({now} vs {before})" for f, (before, now) in per.items() if now < before]
    part = {role: [r for r in rows if roles[r["family"]] == role] for role in ("report", "tune")}
    head = (f"* **The defaults against the previous defaults: {count(rows, 'kv-aware')} of {len(rows)} settings meet "
            f"all three ({count(rows, PREVIOUS)}); report families (held out) {count(part['report'], 'kv-aware')} and "
            f"{count(part['report'], PREVIOUS)} of {len(part['report'])}, tune families {count(part['tune'], 'kv-aware')} "
            f"and {count(part['tune'], PREVIOUS)} of {len(part['tune'])}; imbalance above 1.3 in "
            f"{sum(not judge(r)['ok_imbalance'] for r in rows)} ({sum(not judge(r, PREVIOUS)['ok_imbalance'] for r in rows)}).** ")
    if fewer:
        return head + (f"They meet all three in fewer settings on {', '.join(fewer)} (defaults vs previous): by the "
                       "rule they would not have replaced them.")
    return head + ("They meet all three in at least as many settings as the previous defaults in every family, so "
                   "they replaced them.")


def section(rows: list[dict], roles: dict[str, str], seconds: float, workers: int = 2) -> str:
    labels = ["kv-aware", *CANDIDATES]
    previous = CostModel(**families.PREVIOUS_KNOBS)
    lines = [
        "## Routing: which load the balance band bounds (`bench/routing/load_signal.py`)",
        "",
        seed_line(families.SEED, "every generated family's sessions, arrivals and prompts; the synthetic trace is fixed"),
        "",
        f"The routing families grid (`bench/routing/families.py`: {len(rows)} settings, every family cut to its first "
        f"{families.REQUESTS:,} requests; {grid_text()}, `--hold tokens`), judged by its targets (≥ 90 % of one pool "
        "with N× capacity, ≥ the best baseline within half a point, load imbalance ≤ 1.3). kv-aware's band bounds one "
        f"level per replica, {level_text(CostModel())}: the defaults this bench chose. Until then it bounded "
        f"{level_text(previous)} (*{PREVIOUS}*). Each candidate's level is named by its own weights (recent prefill "
        f"work: tokens dispatched to the replica, decayed with a {HALF_LIFE_S:g} s half-life). Roles: *tune* = the "
        "families the router's defaults were chosen on, *report* = held out.",
        "",
        *diagnosis(rows),
        "",
        "Where the candidates come from: that diagnosis, and a screen by hand of 23 settings drawn from every family "
        "(per family one where the previous defaults miss a target, except noisy-neighbour, where they miss none, and "
        "one where they meet them; two more of api at 8 replicas), so the report families are not wholly unseen by "
        "their form. The first candidate, (2), bounds recent prefill work alone. When the defaults were chosen, in "
        "replays where a prompt became reusable only when its request ended (before the simulators stored its blocks "
        f"at the end of its prefill, as TensorRT-LLM does), (2) lost settings on {SCREEN_FAMILY}, a tune family, so the "
        f"defaults came from a screen on {SCREEN_FAMILY} alone: each variant changes one knob of (2), and one gives the "
        "previous defaults a larger home credit. The defaults are (2) with a quarter of the queued prefill back in its "
        f"level. {screen_premise(rows)} Their {SCREEN_FAMILY} figures are in-sample (the settings they were chosen on); "
        "no other family was used to choose them:",
        "",
        *screen_table(rows),
        "",
        "Settings meeting all three targets, per family. kv-aware (defaults): "
        f"{level_text(CostModel())}; candidates (kv-aware with these cost knobs, the rest its defaults): "
        + "; ".join(f"({i}) {label} ({level_text(CostModel(**knobs))})"
                    for i, (label, (_, knobs, _)) in enumerate(CANDIDATES.items(), start=1)) + ":",
        "",
        *family_table(rows, roles, labels),
        *tables.band_lines(rows, roles, list(CANDIDATES), intro=(
            "The same, summed: on the tune families (where a default is picked), the report families (held out), and "
            "the families where a candidate meets them in fewer settings than the defaults:")),
        "",
        *target_table(rows, labels),
        "",
        *pick(rows, roles),
        "",
        "Adoption (the rule a default follows: at least the current defaults' count of settings meeting all three in "
        "every family, judged on the whole grid):",
        "",
        adopted(rows, roles),
        families.adoption(rows, roles, FIRST),
        "",
        f"{len(rows)} settings × {len(labels)} routers (and the grid's baselines; the screen's {len(SCREEN)} variants on "
        f"{SCREEN_FAMILY} alone), {seconds:,.0f} s with {workers} workers, "
        f"counting passes replayed into the cache separately ({machine()}, shared).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache", type=Path,
                        help="the families grid's cache (families.py --cache, at the same --requests cut: its keys do "
                             "not carry the cut): replay only what it lacks")
    parser.add_argument("--routers", default="",
                        help="comma-separated candidates to replay afresh, ignoring their cached figures (their code "
                             f"may have changed; of: {', '.join(CANDIDATES)})")
    parser.add_argument("--extra-seconds", type=float, default=0.0,
                        help="wall seconds of passes run separately into --cache, added to the total")
    args = parser.parse_args()
    unknown = set(filter(None, args.routers.split(","))) - set(CANDIDATES)
    if unknown:
        parser.error(f"unknown --routers {', '.join(sorted(unknown))}; candidates: {', '.join(CANDIDATES)}")
    grid = argparse.Namespace(only="", requests=families.REQUESTS, workers=args.workers, cache=args.cache,
                              routers=args.routers)
    roles = families.workloads()
    began = time.perf_counter()
    rows, _ = families.replay(roles, grid)
    families.replay_extras(rows, grid, CANDIDATES)
    families.replay_extras([r for r in rows if r["family"] == SCREEN_FAMILY], grid, SCREEN)
    body = section(rows, roles, time.perf_counter() - began + args.extra_seconds, args.workers)
    publish("routing_load_signal", body, write=not args.no_write)


if __name__ == "__main__":
    main()
