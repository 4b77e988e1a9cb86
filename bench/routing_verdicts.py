"""The three routing targets judged in one setting, and why a router misses them.

Shared by ``bench/routing_families.py`` (the grid, its tables and the adoption verdict). A row
is one setting's replays: every router's ``{"hit", "imbalance"}``, the ``ceiling`` (one pool
with N× capacity) and the ``cache only`` diagnostic. Targets: ≥ 90 % of the ceiling, ≥ the
best baseline within half a point (the cut traces are small), load imbalance ≤ 1.3.
"""

from __future__ import annotations

BASELINES = ("random", "round-robin", "session", "dynamo")


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def judge(row: dict, label: str = "kv-aware") -> dict:
    """The three targets for kv-aware (or ``label``) in one setting, and the cache-only diagnostic."""
    kv, ceiling = row[label], row["ceiling"]
    best = max(BASELINES, key=lambda b: row[b]["hit"])
    share = kv["hit"] / ceiling if ceiling else 1.0
    cache_only = row["cache only"]["hit"] / ceiling if ceiling else 1.0
    others = [(k, r) for k, r in row.items() if isinstance(r, dict) and "hit" in r and k != label
              and not k.startswith("tuning:") and (row.get("keyed", True) or k != "kv-aware, no key")]
    return {
        "share": share, "best": best, "vs_best": kv["hit"] / row[best]["hit"] if row[best]["hit"] else 1.0,
        "ok_share": share >= 0.9 or kv["hit"] >= ceiling - 0.005,
        # a tie within half a point of hit rate (the cut traces are small) is not a loss
        "ok_best": kv["hit"] >= row[best]["hit"] - 0.005,
        "ok_imbalance": kv["imbalance"] <= 1.3,
        "cache_only_share": cache_only, "cache_only_imbalance": row["cache only"]["imbalance"],
        # the other placements replayed in this setting that reach 90 % (within 1.3 imbalance / at any)
        "fair": sorted(((r["hit"] / ceiling, k) for k, r in others if r["hit"] / ceiling >= 0.9 and r["imbalance"] <= 1.3),
                       reverse=True) if ceiling else [],
        "reached": any(r["hit"] / ceiling >= 0.9 for _, r in others) if ceiling else True,
    }


def met(j: dict) -> bool:
    return j["ok_share"] and j["ok_best"] and j["ok_imbalance"]


def why(row: dict, j: dict, label: str) -> str:
    """Why ``label`` misses a target in ``row``, by the ceiling diagnostics (cache only)."""
    out = []
    if not j["ok_share"]:
        kind = short_cause(j)
        if kind == "unreachable":
            out.append(f"{pct(j['share'])} % of ceiling; cache only reaches {pct(j['cache_only_share'])} %: "
                       "no placement replayed reaches 90 %")
        elif kind == "needs imbalance":
            out.append(f"{pct(j['share'])} % of ceiling; cache only {pct(j['cache_only_share'])} % needs "
                       f"imbalance {j['cache_only_imbalance']:.2f}")
        elif j["cache_only_share"] >= 0.9 and j["cache_only_imbalance"] <= 1.3:
            out.append(f"{pct(j['share'])} % of ceiling; cache only {pct(j['cache_only_share'])} % at "
                       f"imbalance {j['cache_only_imbalance']:.2f}: the band gives away reuse")
        else:
            share, other = j["fair"][0]
            out.append(f"{pct(j['share'])} % of ceiling; {other} {pct(share)} % within 1.3: the band gives away reuse")
    if not j["ok_best"]:
        out.append(f"{j['vs_best']:.2f}× {j['best']}")
    if not j["ok_imbalance"]:
        out.append(f"imbalance {row[label]['imbalance']:.2f}")
    return "; ".join(out)


def short_cause(j: dict) -> str:
    """Why a setting is below 90 % of the ceiling: ``band`` if cache only or another router replayed
    there reaches 90 % within 1.3 imbalance, ``needs imbalance`` if one reaches it only beyond,
    ``unreachable`` if none does."""
    if (j["cache_only_share"] >= 0.9 and j["cache_only_imbalance"] <= 1.3) or j["fair"]:
        return "band"
    if j["cache_only_share"] >= 0.9 or j["reached"]:
        return "needs imbalance"
    return "unreachable"


def causes(rows: list[dict], label: str) -> dict[str, int]:
    """Misses of ``label`` by cause (a setting may miss more than one target)."""
    js = [(r, judge(r, label)) for r in rows]
    short = [j for _, j in js if not j["ok_share"]]
    lost = [(r, j) for r, j in js if not j["ok_best"]]
    return {
        "all three": sum(met(j) for _, j in js),
        "short": len(short),
        "unreachable": sum(short_cause(j) == "unreachable" for j in short),
        "needs imbalance": sum(short_cause(j) == "needs imbalance" for j in short),
        "band": sum(short_cause(j) == "band" for j in short),
        "lost": len(lost),
        "to session": sum(j["best"] == "session" for _, j in lost),
        "to session within 1.3": sum(j["best"] == "session" and r["session"]["imbalance"] <= 1.3 for r, j in lost),
        "imbalance": sum(not j["ok_imbalance"] for _, j in js),
    }


def all_three(row: dict, label: str) -> bool:
    j = judge(row, label)
    return j["ok_share"] and j["ok_best"] and j["ok_imbalance"]
