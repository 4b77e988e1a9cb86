"""Routing behind several gateways: alone each sees its own dispatches; with routing sync, everyone's.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/routing/gateways.py [--no-write] [--workers 2]
[--gateways 2] [--cache FILE] [--extra-seconds S] [--redis URL]``

Writes the ``bench:routing_gateways`` section of docs/benchmarks.md. Deterministic: the grid of
``bench/routing/families.py`` (every generated family drawn with seed 0, the synthetic trace fixed, each
cut to its first ``families.REQUESTS`` requests), replayed with its own code and judged by its own
targets (``verdicts.judge``).

Why this bench. A gateway replica polls every engine replica for its KV events, so gateways that saw
the same events hold the same indexes; but the load a gateway's cost bounds is what *it* dispatched
(``retention/routing/load.py``), so behind a load balancer each gateway sees its share of the traffic,
and two gateways may send one conversation's turns to different replicas. The family grid models one
gateway; this replays kv-aware's defaults with ``--gateways`` gateways (``ClusterConfig.gateways``: request *i* through gateway *i* mod N, a
round-robin balancer, so consecutive turns of a conversation usually cross gateways), beside the
grid's one-gateway figures. The baselines the targets compare against are the grid's, from one
gateway (random, round-robin and session do not read load; Dynamo's cost does, and is left at one
gateway: the yardstick stays fixed).

Routing sync (``retention/routing/sync.py``, ``server/gateway/replicas/peer_sync.py``): each gateway
publishes its dispatches, first tokens and completions and applies its peers', so load and pending
blocks cover the fleet, late by the sync's delay. The defaults are replayed alone and synced at each of
``SYNC_DELAYS`` (``ClusterConfig.sync_delay_s``); with no delay, synced gateways route exactly as
one (``tests/retention/test_cluster_sim.py``). The delay the real transport adds is measured here
too: notices through two ``PeerSync`` on a real Redis (``--redis``), publish to apply.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, publish, seed_line  # noqa: E402
from bench.routing import families  # noqa: E402
from bench.routing.replays import replay_all  # noqa: E402
from bench.routing.verdicts import judge, met, pct  # noqa: E402

COSTS = {"kv-aware": {}}  # the cost replayed: kv-aware's defaults
# Sync delays replayed (seconds): about twice the transport's p99 measured on this machine while it ran
# two benchmarks (sync_lag: 5 ms), and a transport a hundred times slower.
SYNC_DELAYS = (0.01, 1.0)
LAG_NOTICES = 2000
LAG_HASHES = 64  # a 2,048-token prompt at 32 tokens per block


def run_gateways(knobs: dict, gateways: int, name: str, requests: int, replicas: int, gpu: int, host: int,
                 rate: int, sync_delay: float | None = None) -> dict:
    """kv-aware with cost ``knobs`` behind ``gateways`` gateways, in one setting of the grid; synced when
    ``sync_delay`` is given (its notices applied that many seconds late)."""
    from retention.routing import CostModel
    from retention.simulation.cluster_sim import ClusterConfig, simulate_cluster
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig

    trace = families.load(name, requests)
    if rate != 1:
        trace = [dataclasses.replace(r, timestamp_ms=r.timestamp_ms / rate) for r in trace]
    r = simulate_cluster(trace, lambda: make_policy("trtllm-default" if host else "lru"),
                         cluster=ClusterConfig(replicas, "kv-aware", cost=CostModel(**knobs), gateways=gateways,
                                               sync=sync_delay is not None, sync_delay_s=sync_delay or 0.0),
                         primary_blocks=gpu, secondary_blocks=host * gpu, config=SimConfig(hold="tokens"))
    return {"hit": r.total.hit_rate, "imbalance": r.load_imbalance}


def label(cost: str, gateways: int, sync_delay: float | None = None) -> str:
    synced = "" if sync_delay is None else f", synced ({delay(sync_delay)})"
    return f"{cost}, {gateways} gateways{synced}"


def delay(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


def topologies(gateways: int) -> list[tuple[str, dict, float | None]]:
    """(cost, knobs, sync delay or None) replayed behind ``gateways`` gateways."""
    return [(cost, knobs, d) for cost, knobs in COSTS.items() for d in (None, *SYNC_DELAYS)]


def replay(rows: list[dict], args: argparse.Namespace) -> float:
    """Add every topology's figures behind ``args.gateways`` gateways to the grid's rows (cached like the grid's
    extras in ``<cache>.gateways.jsonl``, keyed by the cost's full knobs and the gateway count, plus the sync
    delay for synced replays)."""
    from retention.routing import CostModel

    store = None if args.cache is None else args.cache.with_suffix(".gateways.jsonl")
    saved = {tuple(k): v for k, v in families.cached(store).items()}
    keys = list(dict.fromkeys((r["family"], r["replicas"], r["gpu_blocks"], r["host"], r["rate"]) for r in rows))

    def key(knobs: dict, sync_delay: float | None, setting: tuple) -> tuple:
        gateways = args.gateways if sync_delay is None else f"{args.gateways} synced {sync_delay:g}"
        return (repr(CostModel(**knobs)), gateways, *setting)

    todo = {key(knobs, d, s): (run_gateways, (knobs, args.gateways, s[0], args.requests, *s[1:], d))
            for _, knobs, d in topologies(args.gateways) for s in keys if key(knobs, d, s) not in saved}
    seconds = replay_all(todo, saved, workers=args.workers, store=store, field="result",
                         progress=lambda k: f"{k[2]} {k[3]} replicas, {k[1]} gateways")
    for r in rows:
        setting = (r["family"], r["replicas"], r["gpu_blocks"], r["host"], r["rate"])
        for cost, knobs, d in topologies(args.gateways):
            r[label(cost, args.gateways, d)] = saved[key(knobs, d, setting)]
    return seconds


def sync_lag(url: str, notices: int = LAG_NOTICES) -> list[float] | None:
    """Seconds from ``PeerSync.publish`` on one gateway to the notice's apply on another, through the Redis at
    ``url``: dispatch notices of ``LAG_HASHES`` block hashes, one per millisecond; sorted, of those that
    arrived within 10 s of the last; None when the subscription never came up (no Redis there)."""
    from retention.routing import Notice
    from server.gateway.replicas.peer_sync import PeerSync

    class Stopwatch:
        def __init__(self) -> None:
            self.lags: list[float] = []

        def apply(self, notice: Notice, *, now: float) -> None:
            self.lags.append(now - float(notice.request_id))

    async def measure() -> list[float] | None:
        watch = Stopwatch()
        namespace = f"bench-{time.time_ns()}"
        sender, receiver = (PeerSync(url, namespace=namespace, gateway=g) for g in ("sender", "receiver"))
        sender.attach(peers_of=lambda _pool: None, pools=list, clock=time.perf_counter)
        receiver.attach(peers_of=lambda _pool: watch, pools=list, clock=time.perf_counter)
        for sync in (sender, receiver):
            sync.start()
        try:
            await asyncio.wait_for(receiver.subscribed.wait(), 5.0)
            hashes = tuple(range(LAG_HASHES))
            for _ in range(notices):
                sender.publish("bench", Notice("sender", "dispatch", f"{time.perf_counter():.9f}", 0, hashes,
                                               LAG_HASHES * 32, 16, 0))
                await asyncio.sleep(0.001)
            deadline = time.perf_counter() + 10.0
            while len(watch.lags) < notices and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
            return sorted(watch.lags)
        except (TimeoutError, OSError):
            return None
        finally:
            for sync in (sender, receiver):
                await sync.close()

    return asyncio.run(measure())


def section(rows: list[dict], roles: dict[str, str], gateways: int, seconds: float, workers: int,
            lag: list[float] | None, redis: str) -> str:
    fams = list(dict.fromkeys(r["family"] for r in rows))
    columns = [*COSTS, *(label(c, gateways, d) for c, _, d in topologies(gateways))]
    heads = [h if h not in COSTS else f"{h}, 1 gateway" for h in columns]

    def count(key: str, subset: list[dict]) -> int:
        return sum(met(judge(r, key)) for r in subset)

    lines = [
        "## Routing behind several gateways (`bench/routing/gateways.py`)",
        "",
        seed_line(families.SEED, "every generated family's sessions, arrivals and prompts; the synthetic trace is fixed"),
        "",
        f"The routing families grid ({len(rows)} settings, every family cut to its first {families.REQUESTS:,} requests, "
        "`--hold tokens`), kv-aware behind one gateway (the grid's own replays) and behind "
        f"{gateways} (`ClusterConfig.gateways`: request *i* through gateway *i* mod {gateways}, each gateway "
        "receiving every replica's KV events). Alone, each gateway counts only its own dispatches; *synced*, each "
        "also applies its peers' dispatches, first tokens and completions (routing sync, `KVGATE_ROUTING_SYNC`), "
        "late by the delay shown. Targets as in the grid (≥ 90 % of one pool with N× capacity, ≥ the best baseline "
        "within half a point, load imbalance ≤ 1.3), the baselines judged at one gateway. Settings meeting all "
        "three, per family:",
        "",
        "| family (role) | settings | " + " | ".join(heads) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for f in fams:
        mine = [r for r in rows if r["family"] == f]
        lines.append(f"| {f} ({roles[f]}) | {len(mine)} | " + " | ".join(str(count(k, mine)) for k in columns) + " |")
    lines.append(f"| **total** | {len(rows)} | " + " | ".join(f"**{count(k, rows)}**" for k in columns) + " |")
    lines += ["", f"Behind {gateways} gateways against one, every setting (hit-rate points; load imbalance):", "",
              "| configuration | hit rate change: min / median / max | worst imbalance, 1 → "
              f"{gateways} gateways | imbalance above 1.3, 1 → {gateways} gateways |", "|---|---:|---:|---:|"]
    for cost, _, d in topologies(gateways):
        key = label(cost, gateways, d)
        change = sorted(100 * (r[key]["hit"] - r[cost]["hit"]) for r in rows)
        lines.append(
            f"| {key} | {change[0]:+.1f} / {statistics.median(change):+.1f} / {change[-1]:+.1f} | "
            f"{max(r[cost]['imbalance'] for r in rows):.2f} → {max(r[key]['imbalance'] for r in rows):.2f} | "
            f"{sum(r[cost]['imbalance'] > 1.3 for r in rows)} → {sum(r[key]['imbalance'] > 1.3 for r in rows)} |")
    one, split = count("kv-aware", rows), count(label("kv-aware", gateways), rows)
    synced = {d: count(label("kv-aware", gateways, d), rows) for d in SYNC_DELAYS}
    shares = sorted(judge(r, label("kv-aware", gateways, SYNC_DELAYS[0]))["share"] for r in rows)
    if lag is None:
        measured = f"The sync's own delay was not measured: no Redis answered at `{redis}`."
    else:
        measured = (f"The sync's own delay, measured in this run through two `PeerSync` on the local Redis "
                    f"({len(lag):,} of {LAG_NOTICES:,} dispatch notices of {LAG_HASHES} block hashes arrived, one sent "
                    f"per millisecond, publish to apply): median "
                    f"{1000 * statistics.median(lag):.2f} ms, p99 {1000 * lag[int(0.99 * (len(lag) - 1))]:.2f} ms, "
                    f"max {1000 * lag[-1]:.2f} ms.")
    lines += ["", f"Reading: behind {gateways} gateways the defaults meet all three in {split} of {len(rows)} settings "
              f"alone and in " + ", ".join(f"{n} synced at {delay(d)}" for d, n in synced.items())
              + f", against {one} behind one gateway. " + measured,
              "",
              f"{len(rows)} settings × {len(topologies(gateways))} configurations behind {gateways} gateways, "
              f"{seconds:,.0f} s with {workers} workers ({machine()}, shared); the one-gateway figures are the grid's. "
              f"The share of the ceiling for the defaults behind {gateways} gateways synced at "
              f"{delay(SYNC_DELAYS[0])}, min / median: {pct(shares[0])} / {pct(shares[len(shares) // 2])} %."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2, help="gateways behind the balancer (default: %(default)s)")
    parser.add_argument("--cache", type=Path,
                        help="the families grid's cache (families.py --cache): its one-gateway rows are read from it")
    parser.add_argument("--extra-seconds", type=float, default=0.0,
                        help="wall seconds of an earlier run's gateway replays into --cache, added to the total")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                        help="the Redis the sync's delay is measured through (default: %(default)s)")
    args = parser.parse_args()
    if args.gateways < 2:
        parser.error("--gateways: 2 or more (one gateway is the families grid itself)")
    grid = argparse.Namespace(only="", requests=families.REQUESTS, workers=args.workers, cache=args.cache, routers="")
    args.requests = families.REQUESTS
    roles = families.workloads()
    rows, _ = families.replay(roles, grid)
    seconds = replay(rows, args)  # the gateways' replays alone: the grid's own are timed by its section
    lag = sync_lag(args.redis)
    body = section(rows, roles, args.gateways, seconds + args.extra_seconds, args.workers, lag, args.redis)
    publish("routing_gateways", body, write=not args.no_write)


if __name__ == "__main__":
    main()
