"""The three routing targets judged in one setting (why a router misses one: ``routing_frontier``).

Shared by ``bench/routing/families.py`` (the grid, its tables and the adoption verdict). A row
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
    return {
        "share": share, "best": best, "vs_best": kv["hit"] / row[best]["hit"] if row[best]["hit"] else 1.0,
        "ok_share": share >= 0.9 or kv["hit"] >= ceiling - 0.005,
        # a tie within half a point of hit rate (the cut traces are small) is not a loss
        "ok_best": kv["hit"] >= row[best]["hit"] - 0.005,
        "ok_imbalance": kv["imbalance"] <= 1.3,
        "cache_only_share": cache_only, "cache_only_imbalance": row["cache only"]["imbalance"],
    }


def met(j: dict) -> bool:
    return j["ok_share"] and j["ok_best"] and j["ok_imbalance"]


def all_three(row: dict, label: str) -> bool:
    j = judge(row, label)
    return j["ok_share"] and j["ok_best"] and j["ok_imbalance"]
