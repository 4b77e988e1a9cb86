"""Routing behind several gateways: each counts only its own dispatches, so each sees part of the load.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/routing/gateways.py [--no-write] [--workers 2]
[--gateways 2] [--cache FILE] [--extra-seconds S]``

Writes the ``bench:routing_gateways`` section of docs/benchmarks.md. Deterministic: the grid of
``bench/routing/families.py`` (every generated family drawn with seed 0, the synthetic trace fixed, each
cut to its first ``families.REQUESTS`` requests), replayed with its own code and judged by its own
targets (``verdicts.judge``).

Why this bench. A gateway replica polls every engine replica for its KV events, so gateways that saw
the same events hold the same indexes; but the load a gateway's cost bounds is what *it* dispatched
(``retention/routing/load.py``), so behind a load balancer each gateway sees its share of the traffic,
and two gateways may send one conversation's turns to different replicas. The family grid models one
gateway; this replays kv-aware's defaults and its previous defaults (``families.PREVIOUS_KNOBS``) with
``--gateways`` gateways (``ClusterConfig.gateways``: request *i* through gateway *i* mod N, a
round-robin balancer, so consecutive turns of a conversation usually cross gateways), beside the
grid's one-gateway figures. The baselines the targets compare against are the grid's, from one
gateway (random, round-robin and session do not read load; Dynamo's cost does, and is left at one
gateway: the yardstick stays fixed).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, write_section  # noqa: E402
from bench.routing import families  # noqa: E402
from bench.routing.replays import replay_all  # noqa: E402
from bench.routing.verdicts import judge, met, pct  # noqa: E402

PREVIOUS = "kv-aware, previous defaults"  # families.FIXED's row: its one-gateway figures come from the grid
COSTS = {"kv-aware": {}, PREVIOUS: families.PREVIOUS_KNOBS}


def run_gateways(knobs: dict, gateways: int, name: str, requests: int, replicas: int, gpu: int, host: int,
                 rate: int) -> dict:
    """kv-aware with cost ``knobs`` behind ``gateways`` gateways, in one setting of the grid."""
    from retention.routing import CostModel
    from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig

    trace = families.load(name, requests)
    if rate != 1:
        trace = [dataclasses.replace(r, timestamp_ms=r.timestamp_ms / rate) for r in trace]
    r = simulate_cluster(trace, lambda: make_policy("trtllm-default" if host else "lru"),
                         cluster=ClusterConfig(replicas, "kv-aware", cost=CostModel(**knobs), gateways=gateways),
                         primary_blocks=gpu, secondary_blocks=host * gpu, config=SimConfig(hold="tokens"))
    return {"hit": r.total.hit_rate, "imbalance": r.load_imbalance}


def label(cost: str, gateways: int) -> str:
    return f"{cost}, {gateways} gateways"


def replay(rows: list[dict], args: argparse.Namespace) -> float:
    """Add every cost's figures behind ``args.gateways`` gateways to the grid's rows (cached like the grid's extras,
    keyed by the cost's full knobs and the gateway count, in ``<cache>.gateways.jsonl``)."""
    from retention.routing import CostModel

    store = None if args.cache is None else args.cache.with_suffix(".gateways.jsonl")
    saved = {tuple(k): v for k, v in families.cached(store).items()}
    keys = list(dict.fromkeys((r["family"], r["replicas"], r["gpu_blocks"], r["host"], r["rate"]) for r in rows))
    todo = {(repr(CostModel(**knobs)), args.gateways, *key): (run_gateways, (knobs, args.gateways, key[0], args.requests,
                                                                            *key[1:]))
            for knobs in COSTS.values() for key in keys
            if (repr(CostModel(**knobs)), args.gateways, *key) not in saved}
    seconds = replay_all(todo, saved, workers=args.workers, store=store, field="result",
                         progress=lambda k: f"{k[2]} {k[3]} replicas, {k[1]} gateways")
    for r in rows:
        for cost, knobs in COSTS.items():
            r[label(cost, args.gateways)] = saved[(repr(CostModel(**knobs)), args.gateways, r["family"], r["replicas"],
                                                   r["gpu_blocks"], r["host"], r["rate"])]
    return seconds


def section(rows: list[dict], roles: dict[str, str], gateways: int, seconds: float, workers: int) -> str:
    fams = list(dict.fromkeys(r["family"] for r in rows))
    columns = [(cost, n) for cost in COSTS for n in (1, gateways)]

    def key(cost: str, n: int) -> str:
        return cost if n == 1 else label(cost, n)

    lines = [
        "## Routing behind several gateways (`bench/routing/gateways.py`)",
        "",
        seed_line(families.SEED, "every generated family's sessions, arrivals and prompts; the synthetic trace is fixed"),
        "",
        f"The routing families grid ({len(rows)} settings, every family cut to its first {families.REQUESTS:,} requests, "
        "`--hold tokens`), kv-aware's defaults and its previous defaults behind one gateway (the grid's own replays) "
        f"and behind {gateways} (`ClusterConfig.gateways`: request *i* through gateway *i* mod {gateways}, each gateway "
        "receiving every replica's KV events and counting only its own dispatches). Targets as in the grid (≥ 90 % of "
        "one pool with N× capacity, ≥ the best baseline within half a point, load imbalance ≤ 1.3), the baselines "
        "judged at one gateway. Settings meeting all three, per family:",
        "",
        "| family (role) | settings | " + " | ".join(f"{cost}, {n} gateway{'s' if n > 1 else ''}" for cost, n in columns)
        + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for f in fams:
        mine = [r for r in rows if r["family"] == f]
        lines.append(f"| {f} ({roles[f]}) | {len(mine)} | "
                     + " | ".join(str(sum(met(judge(r, key(c, n))) for r in mine)) for c, n in columns) + " |")
    lines.append(f"| **total** | {len(rows)} | "
                 + " | ".join(f"**{sum(met(judge(r, key(c, n))) for r in rows)}**" for c, n in columns) + " |")
    lines += ["", f"Behind {gateways} gateways against one, every setting (hit-rate points; load imbalance):", "",
              "| cost | hit rate change: min / median / max | worst imbalance, 1 → "
              f"{gateways} gateways | imbalance above 1.3, 1 → {gateways} gateways |", "|---|---:|---:|---:|"]
    for cost in COSTS:
        change = sorted(100 * (r[key(cost, gateways)]["hit"] - r[cost]["hit"]) for r in rows)
        lines.append(
            f"| {cost} | {change[0]:+.1f} / {statistics.median(change):+.1f} / {change[-1]:+.1f} | "
            f"{max(r[cost]['imbalance'] for r in rows):.2f} → {max(r[key(cost, gateways)]['imbalance'] for r in rows):.2f} | "
            f"{sum(r[cost]['imbalance'] > 1.3 for r in rows)} → {sum(r[key(cost, gateways)]['imbalance'] > 1.3 for r in rows)} |")
    now, before = (sum(met(judge(r, key(c, gateways))) for r in rows) for c in COSTS)
    shares = sorted(judge(r, key("kv-aware", gateways))["share"] for r in rows)
    worse = [f"{f} ({a} vs {b})" for f in fams
             for a, b in [(sum(met(judge(r, key("kv-aware", gateways))) for r in rows if r["family"] == f),
                           sum(met(judge(r, key(PREVIOUS, gateways))) for r in rows if r["family"] == f))] if a < b]
    lines += ["", f"Reading: behind {gateways} gateways the defaults meet all three in {now} of {len(rows)} settings, the "
              f"previous defaults in {before}; "
              + (f"the defaults meet them in fewer settings on {', '.join(worse)} (defaults vs previous)."
                 if worse else "the defaults meet them in at least as many settings in every family."),
              "",
              f"{len(rows)} settings × {len(COSTS)} costs behind {gateways} gateways, {seconds:,.0f} s with {workers} "
              f"workers ({machine()}, shared); the one-gateway figures are the grid's. The share of the ceiling "
              f"for the defaults behind {gateways} gateways, min / median: "
              f"{pct(shares[0])} / {pct(shares[len(shares) // 2])} %."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2, help="gateways behind the balancer (default: %(default)s)")
    parser.add_argument("--cache", type=Path,
                        help="the families grid's cache (families.py --cache): its one-gateway rows are read from it")
    parser.add_argument("--extra-seconds", type=float, default=0.0,
                        help="wall seconds of an earlier run into --cache, added to the total")
    args = parser.parse_args()
    if args.gateways < 2:
        parser.error("--gateways: 2 or more (one gateway is the families grid itself)")
    grid = argparse.Namespace(only="", requests=families.REQUESTS, workers=args.workers, cache=args.cache, routers="")
    args.requests = families.REQUESTS
    roles = families.workloads()
    began = time.perf_counter()
    rows, _ = families.replay(roles, grid)
    families.replay_extras(rows, grid, {PREVIOUS: families.EXTRAS[PREVIOUS]})
    replay(rows, args)
    body = section(rows, roles, args.gateways, time.perf_counter() - began + args.extra_seconds, args.workers)
    print(body)
    if not args.no_write:
        write_section("routing_gateways", body)
        print("wrote docs/benchmarks.md section bench:routing_gateways")


if __name__ == "__main__":
    main()
