"""The routing-families bench's tables: cost variants, one router against kv-aware, fixed bands, knob table.

Used by ``bench/routing/families.py``; pure rendering of its rows (no replays). A row is one
setting's replays (``routing_verdicts``); the targets are judged by ``verdicts.judge``.
"""

from __future__ import annotations

from bench.routing.frontier import where
from bench.routing.verdicts import judge, met, pct


def variant_lines(variants: list[dict], labels: list[str]) -> list[str]:
    """The cost variants (``labels``, in order) at the variant settings, as shares of the ceiling."""
    if not variants:
        return []
    out = [
        "",
        "The band's knobs around the defaults — kv-aware cost variants on the **tune** families only (share of the "
        "ceiling %, load imbalance in brackets; each row changes one knob from the defaults, which were chosen in "
        "\"Routing: which load the balance band bounds\"):",
        "",
        "| variant | " + " | ".join(f"{v['family']} {where(v)}" for v in variants) + " | settings meeting ≥ 90 % and ≤ 1.3 |",
        "|---|" + "---:|" * (len(variants) + 1),
    ]
    for label in labels:
        cells, meeting = [], 0
        for v in variants:
            share = v[label]["hit"] / v["ceiling"] if v["ceiling"] else 1.0
            meeting += share >= 0.9 and v[label]["imbalance"] <= 1.3
            cells.append(f"{pct(share)} ({v[label]['imbalance']:.2f})")
        out.append(f"| {label} | " + " | ".join(cells) + f" | {meeting} of {len(variants)} |")
    return out


def family_table(rows: list[dict], roles: dict[str, str], label: str, against: str = "kv-aware") -> list[str]:
    """Per family: settings where ``against`` and ``label`` meet all three, and ``label``'s figures."""
    out = [
        f"| family | role | {against}: all three | {label}: all three | ≥ 90 % | ≥ best baseline | ≤ 1.3 | "
        "of ceiling (min / median) | worst imbalance |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        base = [judge(r, against) for r in mine]
        cand = [judge(r, label) for r in mine]
        shares = sorted(j["share"] for j in cand)
        out.append(
            f"| {fam} | {roles[fam]} | {sum(met(j) for j in base)} | {sum(met(j) for j in cand)} | "
            f"{sum(j['ok_share'] for j in cand)} | {sum(j['ok_best'] for j in cand)} | "
            f"{sum(j['ok_imbalance'] for j in cand)} | {pct(shares[0])} / {pct(shares[len(shares) // 2])} % | "
            f"{max(r[label]['imbalance'] for r in mine):.2f} |"
        )
    return out


BAND_INTRO = ("kv-aware's band from tight to loose (the frontier's fixed bands) and the previous defaults as candidates, "
              "settings meeting all three: on the tune families (where a band would be picked), the report families, and "
              "the families where it meets them in fewer settings than the defaults:")


def band_lines(rows: list[dict], roles: dict[str, str], candidates: list[str], intro: str = BAND_INTRO) -> list[str]:
    """``candidates`` (the frontier's fixed bands and the fixed variants, or any kv-aware variant) judged beside
    kv-aware's defaults: what picking one on the tune families alone would choose, and what it does on the report
    families."""
    labels = ["kv-aware", *(c for c in candidates if c in rows[0])]
    if len(labels) == 1:
        return []
    fams = list(dict.fromkeys(r["family"] for r in rows))
    count = {(label, f): sum(met(judge(r, label)) for r in rows if r["family"] == f) for label in labels for f in fams}
    out = ["", intro, "",
           "| band or variant | tune | report | total | imbalance above 1.3 | fewer than kv-aware on |", "|---|---:|---:|---:|---:|---|"]
    for label in labels:
        tune = sum(count[(label, f)] for f in fams if roles[f] == "tune")
        report = sum(count[(label, f)] for f in fams if roles[f] == "report")
        worse = ", ".join(f"{f} ({count[(label, f)]} vs {count[('kv-aware', f)]})" for f in fams
                          if count[(label, f)] < count[("kv-aware", f)]) or "–"
        out.append(f"| {label} | {tune} | {report} | {tune + report} | "
                   f"{sum(r[label]['imbalance'] > 1.3 for r in rows)} | {worse} |")
    return out


def tuning_lines(tuned: list[dict] | None, adaptive: str, source: str) -> list[str]:
    """The self-tuning band's knob table (``--tune-only``'s output, read from ``source``, with the cut it ran on)."""
    if not tuned:
        return []
    from retention.routing import CostModel

    fams = list(tuned[0]["counts"])
    costs = {t.get("cost", "(unrecorded)") for t in tuned}
    over = ("over kv-aware's cost defaults" if costs == {repr(CostModel())}
            else "over " + " and ".join(sorted(costs)) + ", not today's kv-aware defaults")
    out = [
        "",
        f"How the self-tuning band's own knobs were chosen — {adaptive} variants on the **tune** families only, "
        f"every tune setting ({tuned[0]['settings']}), each trace cut to its first {tuned[0].get('requests', '(unrecorded)')} "
        f"requests ({source}), each {over}; settings meeting all three targets (the first row is the default, the "
        "knobs of `BandTuning`):",
        "",
        "| variant | " + " | ".join(fams) + " | total | imbalance above 1.3 | worst imbalance |",
        "|---|" + "---:|" * (len(fams) + 3),
    ]
    for t in tuned:
        out.append(f"| {t['variant']} | " + " | ".join(str(t["counts"][f]) for f in fams)
                   + f" | {t['total']} of {t['settings']} | {t.get('imbalance_misses', '–')} | {t['worst_imbalance']:.2f} |")
    return out
