"""Whether a router's loss to a baseline repeats on other draws of the same workload family.

Used by ``bench/routing/families.py``. For every setting where a router loses to the best
baseline by more than the target's half point, the router and every baseline beating it are
replayed on the family generated with each of ``NOISE_SEEDS`` (same replicas, GPU share, host,
rate; GPU blocks recomputed from that draw). The verdict in ``routing_frontier`` reads
*within noise* when on every other draw the router is within half a point of every such
baseline: the loss does not repeat, so it is the draw's, not the family's. The synthetic trace is one fixed
trace (no generator seed): its losses are never called noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bench.routing.replays import replay_all
from bench.routing.verdicts import BASELINES

NOISE_SEEDS = (1, 2)
TIE = 0.005  # the best-baseline target's half point


def losers(row: dict, label: str) -> list[str]:
    """The baselines ``label`` loses to in ``row`` by more than half a point."""
    return [b for b in BASELINES if row[label]["hit"] < row[b]["hit"] - TIE]


def replay(rows: list[dict], labels: tuple[str, ...], run: Callable[..., float], requests: int, workers: int,
           store: Path | None) -> float:
    """Add ``row["seeds"][label] = [[seed, label's hit, {baseline: hit}], ...]`` wherever ``label``
    loses to a baseline (not on the synthetic trace); returns the wall seconds. ``run(label, family,
    requests, replicas, share, host, rate, seed)`` replays one router on one draw (a module-level
    function: it runs in worker processes); ``store`` caches every replay (one JSON line per label,
    setting and seed)."""
    key = lambda lab, r, s: [lab, r["family"], r["replicas"], r["share"], r["host"], r["rate"], s]  # noqa: E731
    saved = {}
    if store is not None and store.exists():
        saved = {tuple(e["key"]): e["hit"] for e in map(json.loads, store.read_text().splitlines())}
    need = {tuple(key(lab, r, s)) for label in labels for r in rows if r["family"] != "synthetic"
            for lab in ([label, *losers(r, label)] if losers(r, label) else []) for s in NOISE_SEEDS}
    todo = {k: (run, (k[0], k[1], requests, *k[2:])) for k in sorted(need - set(saved))}
    seconds = replay_all(todo, saved, workers=workers, store=store, field="hit", progress=lambda _: "seeds")
    for r in rows:
        r["seeds"] = {label: [[s, saved[tuple(key(label, r, s))], {b: saved[tuple(key(b, r, s))] for b in losers(r, label)}]
                              for s in NOISE_SEEDS] for label in labels if r["family"] != "synthetic" and losers(r, label)}
    return seconds
