"""Each missed routing target classified against the measured frontier of its setting.

Shared by ``bench/routing/families.py``. A row is one setting's replays (``routing_verdicts``):
every placement the bench replays there — the baselines, kv-aware and its diagnostics (no key,
cache only), the self-tuning routers, the previous defaults and the band sweep — each a point
``(hit rate, load imbalance)``. The frontier is that set of points; nothing here is tuned, it
only reads the points. A target a router misses is:

* **≥ 90 % of the ceiling** — *infeasible* if no replayed placement reaches it within 1.3
  imbalance (the verdict states the best within 1.3 and the least imbalance at which one
  reaches 90 %), else a *router shortfall* (the verdict names a placement that reaches it).
* **≥ the best baseline** — a *trade-off* if every baseline that beats the router (by more
  than the target's half point) does so only above 1.3 imbalance and no placement within 1.3
  reaches the best baseline's hit rate (both stated); *within noise* if the loss does not repeat:
  on every other draw of the family (``routing_seeds``: generator seeds 1 and 2, same setting)
  the router is within half a point of every baseline beating it here; else a *router shortfall*.
* **imbalance ≤ 1.3** — *infeasible* if no placement that meets the other two targets stays
  within 1.3, else a *router shortfall* (the placement meeting all three is named).

A setting is *explained* when every target it misses is infeasible, a trade-off or within noise. Invariant:
a verdict of infeasible or trade-off is never given when some replayed placement within 1.3
imbalance meets the target in question (the router's own point included).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.routing.seeds import NOISE_SEEDS
from bench.routing.verdicts import BASELINES, pct

SHARE, IMBALANCE, TIE = 0.9, 1.3, 0.005  # the targets; a tie within half a point of hit rate is not a loss
SMALL_BLOCKS = 50  # a ceiling under this many hit blocks: one block is over 2 % of it
TOKENS_PER_BLOCK = 512  # SimConfig.tokens_per_block, the pool's block (the grid's GPU blocks count these too)
EXPLAINED = ("infeasible", "trade-off", "within noise")


@dataclass(frozen=True, slots=True)
class Point:
    """One placement replayed in one setting."""

    label: str
    hit: float
    imbalance: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """One missed target: ``target`` in {share, best, imbalance}, ``kind`` in {infeasible,
    trade-off, within noise, shortfall}; ``witness`` names the placement that shows the kind (or "")."""

    target: str
    kind: str
    text: str
    witness: str = ""


def points(row: dict) -> list[Point]:
    """Every placement replayed in ``row`` (not the ``tuning:`` sweep, which only the tune pass has;
    not *kv-aware, no key* where no request carries a key: it is then kv-aware's own replay)."""
    return [Point(k, v["hit"], v["imbalance"]) for k, v in row.items()
            if isinstance(v, dict) and "hit" in v and not k.startswith("tuning:")
            and (row.get("keyed", True) or k != "kv-aware, no key")]


def pareto(pts: list[Point]) -> list[Point]:
    """The points no other point beats on both hit rate (higher) and imbalance (lower), by imbalance."""
    out: list[Point] = []
    for p in sorted(pts, key=lambda p: (p.imbalance, -p.hit)):
        if not out or p.hit > out[-1].hit:
            out.append(p)
    return out


def share_ok(hit: float, ceiling: float) -> bool:
    return not ceiling or hit / ceiling >= SHARE or hit >= ceiling - TIE


def small(row: dict) -> int | None:
    """The ceiling's hit blocks if fewer than ``SMALL_BLOCKS`` (its shares are ratios of small numbers)."""
    blocks = round(row.get("ceiling_hit_tokens", SMALL_BLOCKS * TOKENS_PER_BLOCK) / TOKENS_PER_BLOCK)
    return blocks if blocks < SMALL_BLOCKS else None


def _at(p: Point, ceiling: float) -> str:
    return f"{p.label} {pct(p.hit / ceiling if ceiling else 1.0)} % at {p.imbalance:.2f}"


def classify(row: dict, label: str) -> list[Verdict]:
    """The verdict on each target ``label`` misses in ``row`` (empty if it meets all three)."""
    pts, ceiling = points(row), row["ceiling"]
    me = next(p for p in pts if p.label == label)
    best = max(BASELINES, key=lambda b: row[b]["hit"])
    top = row[best]["hit"]
    within = [p for p in pts if p.imbalance <= IMBALANCE]
    out = []
    if not share_ok(me.hit, ceiling):
        meeting = [p for p in within if share_ok(p.hit, ceiling)]
        if meeting:
            w = max(meeting, key=lambda p: p.hit)
            out.append(Verdict("share", "shortfall", f"{_at(w, ceiling)} of ceiling", w.label))
        else:
            reach = [p for p in pts if share_ok(p.hit, ceiling)]
            w = max(within, key=lambda p: p.hit, default=None)
            text = f"best within 1.3 {_at(w, ceiling)}" if w else "no placement within 1.3"
            if reach:
                n = min(reach, key=lambda p: p.imbalance)
                text += f"; 90 % needs imbalance {n.imbalance:.2f} ({n.label})"
            else:
                text += f"; no placement reaches 90 % (most: {_at(max(pts, key=lambda p: p.hit), ceiling)})"
            out.append(Verdict("share", "infeasible", text))
    if me.hit < top - TIE:
        beaters = [b for b in BASELINES if me.hit < row[b]["hit"] - TIE and row[b]["imbalance"] <= IMBALANCE]
        reach = [p for p in within if p.hit >= top - TIE]
        # the loss does not repeat: on every other draw of the family the router is within half a point of
        # every baseline beating it here (a loss repeated on one draw of three is not called noise)
        runs = row.get("seeds", {}).get(label, [])
        noise = bool(runs) and all(mine >= hit - TIE for _, mine, theirs in runs for hit in theirs.values())
        if not (beaters or reach):
            w = max(within, key=lambda p: p.hit, default=None)
            out.append(Verdict("best", "trade-off", f"{best} {pct(top)} % only at {row[best]['imbalance']:.2f}; best "
                                                    f"within 1.3 " + (f"{w.label} {pct(w.hit)} % at {w.imbalance:.2f}"
                                                                      if w else "none")))
        elif noise:
            out.append(Verdict("best", "within noise", f"{best} {pct(top)} % vs {pct(me.hit)} %; within half a point "
                                                       f"on seeds {' and '.join(str(r[0]) for r in runs)}"))
        elif beaters:
            b = max(beaters, key=lambda b: row[b]["hit"])
            out.append(Verdict("best", "shortfall", f"{b} {pct(row[b]['hit'])} % at {row[b]['imbalance']:.2f} "
                                                    f"vs {pct(me.hit)} %", b))
        else:
            w = max(reach, key=lambda p: p.hit)
            out.append(Verdict("best", "shortfall", f"{best} {pct(top)} % at {row[best]['imbalance']:.2f}, reached "
                                                    f"within 1.3 by {w.label} {pct(w.hit)} % at {w.imbalance:.2f}",
                               w.label))
    if me.imbalance > IMBALANCE:
        both = [p for p in pts if share_ok(p.hit, ceiling) and p.hit >= top - TIE]
        meeting = [p for p in both if p.imbalance <= IMBALANCE]
        if meeting:
            w = max(meeting, key=lambda p: p.hit)
            out.append(Verdict("imbalance", "shortfall", f"{me.imbalance:.2f}; {_at(w, ceiling)} meets all three",
                               w.label))
        elif both:
            n = min(both, key=lambda p: p.imbalance)
            out.append(Verdict("imbalance", "infeasible", f"{me.imbalance:.2f}; ≥ 90 % and ≥ {best} need imbalance "
                                                          f"{n.imbalance:.2f} ({n.label})"))
        else:
            out.append(Verdict("imbalance", "infeasible", f"{me.imbalance:.2f}; no placement meets ≥ 90 % and "
                                                          f"≥ {best} at any imbalance"))
    return out


def explained(verdicts: list[Verdict]) -> bool:
    """A missed setting whose every missed target is infeasible, a trade-off or within noise."""
    return all(v.kind in EXPLAINED for v in verdicts)


def line(verdicts: list[Verdict]) -> str:
    """The verdicts as one miss-list entry."""
    names = {"share": "≥ 90 %", "best": "≥ best", "imbalance": "imbalance"}
    return "; ".join(f"{names[v.target]} {v.kind}: {v.text}" for v in verdicts)


def tally(rows: list[dict], label: str) -> dict:
    """``label``'s misses in ``rows``: settings missed, explained, shortfall, small-number; and per
    target and kind the verdicts; and the shortfall verdicts per (target, witness)."""
    out = {"settings": len(rows), "missed": 0, "explained": 0, "shortfall": 0, "small": 0, "kinds": {}, "witnesses": {}}
    for r in rows:
        vs = classify(r, label)
        if not vs:
            continue
        out["missed"] += 1
        out["explained" if explained(vs) else "shortfall"] += 1
        out["small"] += small(r) is not None
        for v in vs:
            out["kinds"][(v.target, v.kind)] = out["kinds"].get((v.target, v.kind), 0) + 1
            if v.kind == "shortfall":
                out["witnesses"][(v.target, v.witness)] = out["witnesses"].get((v.target, v.witness), 0) + 1
    return out


def where(row: dict) -> str:
    return f"{row['replicas']}×{row['share']:.0%} h{row['host']} r×{row['rate']}"


def _status(verdicts: list[Verdict]) -> str:
    if not verdicts:
        return "all three"
    return ", ".join(f"{v.target} {v.kind}" for v in verdicts)


def lines(rows: list[dict], roles: dict[str, str], labels: tuple[str, str]) -> list[str]:
    """The frontier verdicts: per family and label, missed settings explained or short; per target
    the kinds; and ``labels[0]``'s miss list with ``labels[1]``'s status on the same setting."""
    first, second = labels
    fams = list(dict.fromkeys(r["family"] for r in rows))
    sweep = sorted({p.label for r in rows for p in points(r)})
    out = [
        "",
        "### Every miss against the measured frontier",
        "",
        f"Per setting, the frontier is every placement replayed there ({len(sweep)}: {', '.join(sweep)}), each a point "
        "(hit rate, load imbalance); the band sweep (`BANDS`: kv-aware's `balance_request_share` and `balance_rel` "
        "set from tight to loose around the defaults, the existing knobs) is replayed for it only. A missed target is *infeasible* (≥ 90 %: no "
        "placement reaches 90 % of the ceiling within 1.3 imbalance; imbalance: no placement meeting the other two "
        "stays within 1.3), a *trade-off* (≥ best baseline: every baseline that beats the router does so only above "
        "1.3 and no placement within 1.3 reaches it), *within noise* (≥ best baseline: the router and every baseline "
        "beating it replayed on the family drawn with generator seeds "
        f"{' and '.join(map(str, NOISE_SEEDS))}, same setting, and on each the router is within half a point of them: "
        "the loss does not repeat; never on the synthetic trace, which has no generator seed), else a *router shortfall* (a named "
        "placement meets it within 1.3). A setting is *explained* when every target it misses is infeasible, a "
        f"trade-off or within noise. *Small ceiling*: the ceiling hits fewer than {SMALL_BLOCKS} blocks "
        f"of {TOKENS_PER_BLOCK} tokens (one block over 2 % of it; still classified). The Pareto frontier of every "
        "setting: `docs/data/routing_frontier.jsonl`.",
        "",
        f"| family | role | {first}: missed | explained | shortfall | {second}: missed | explained | shortfall | "
        "small ceiling (settings) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fam in [*fams, None]:
        mine = [r for r in rows if fam is None or r["family"] == fam]
        a, b = tally(mine, first), tally(mine, second)
        name = f"| {fam} | {roles[fam]}" if fam else f"| **total** ({len(rows)} settings) |"
        out.append(f"{name} | {a['missed']} | {a['explained']} | {a['shortfall']} | {b['missed']} | {b['explained']} | "
                   f"{b['shortfall']} | {sum(small(r) is not None for r in mine)} |")
    a, b = tally(rows, first), tally(rows, second)
    out += ["", f"Missed targets by verdict (a setting may miss more than one), {first} and {second}:", "",
            "| target | infeasible | trade-off | within noise | router shortfall |", "|---|---:|---:|---:|---:|"]
    for label, t in ((first, a), (second, b)):
        for target, name in (("share", "≥ 90 % of ceiling"), ("best", "≥ best baseline"), ("imbalance", "imbalance ≤ 1.3")):
            out.append(f"| {label}: {name} | " + " | ".join(str(t["kinds"].get((target, k), 0))
                                                           for k in ("infeasible", "trade-off", "within noise", "shortfall")) + " |")
    missed = [(r, classify(r, first), classify(r, second)) for r in rows]
    missed = [(r, x, y) for r, x, y in missed if x]
    out += ["", f"Settings where {first} misses a target ({len(missed)} of {len(rows)}; `R×G% hH r×K` = R replicas, "
            f"G % GPU each, host H×, arrival rate ×K; shares of the ceiling, imbalance after *at*; then {second} on the "
            "same setting):", ""]
    for r, x, y in missed:
        n = small(r)
        out.append(f"* {r['family']} ({roles[r['family']]}) {where(r)}" + (f" [small ceiling: {n} blocks]" if n is not None
                                                                           else "")
                   + f": {'explained' if explained(x) else 'SHORTFALL'} — {line(x)} · {second}: {_status(y)}")
    return out


def reading(rows: list[dict], labels: tuple[str, ...]) -> list[str]:
    """The verdict counts as reading bullets, with each label's largest shortfall groups."""
    out = []
    for label in labels:
        t = tally(rows, label)
        groups = sorted(t["witnesses"].items(), key=lambda kv: -kv[1])[:4]
        names = {"share": "≥ 90 %", "best": "≥ best baseline", "imbalance": "imbalance"}
        out.append(
            f"* **{label} misses a target in {t['missed']} of {t['settings']} settings: {t['explained']} explained by "
            f"measurement (every missed target infeasible, a trade-off or within noise), {t['shortfall']} router "
            f"shortfalls** ({t['small']} of the missed settings have a small ceiling). Largest shortfall groups "
            "(target: the placement that meets it within 1.3): "
            + "; ".join(f"{names[target]}: {w} ({n})" for (target, w), n in groups) + "."
        )
    return out


def records(rows: list[dict], labels: tuple[str, ...]) -> list[dict]:
    """One record per setting: its Pareto frontier (label, hit, imbalance) and each label's verdicts."""
    return [{"family": r["family"], "replicas": r["replicas"], "share": r["share"], "host": r["host"], "rate": r["rate"],
             "ceiling": r["ceiling"], "ceiling_hit_blocks": round(r.get("ceiling_hit_tokens", 0) / TOKENS_PER_BLOCK),
             "pareto": [[p.label, round(p.hit, 5), round(p.imbalance, 4)] for p in pareto(points(r))],
             "verdicts": {label: [[v.target, v.kind, v.text] for v in classify(r, label)] for label in labels}}
            for r in rows]
