"""Routing targets against trace length: what a 300-request cut does to the family grid's verdicts.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/routing/trace_length.py [--no-write] [--workers 2]
[--requests 300,1200] [--only agent,chat] [--cache FILE]``

``--cache`` is the families grid's cache (``families.py --cache``): the settings at the grid's own cut
(``families.REQUESTS``) are read from it — the same replays, keyed the same way — and only what it lacks is
replayed; every other length is replayed here.

Writes the ``bench:routing_trace_length`` section of docs/benchmarks.md and
``docs/img/routing_trace_length.png``. Deterministic: every family drawn with seed 0, as
``bench/routing/families.py`` draws it.

``bench/routing/families.py`` was first run on traces cut to their first 300 requests (594
settings, 17 placements each; the self-tuning band's knobs were chosen there), and this bench is
why it now cuts them to 2,000. Load imbalance there is max / mean prefill tokens per replica
*over the whole cut trace*; at 300 requests with 8 replicas that is about 37 requests per replica,
so the statistic is noisy, and a noisy maximum over 8 replicas is biased upwards: even the random
router, which balances in expectation, reads above 1.3 in some families. This bench replays the same settings at several
trace lengths, with the grid's own code (``families.run_setting``, ``families.run_extra``,
``verdicts.judge``), and counts the targets met at each.

* Settings: the grid's, every family of ``retention/workloads/`` and the synthetic trace × 2/4/8
  replicas × 1/2/5 % GPU per replica × host 0 (``lru``) / 4× (``trtllm-default``) × arrival rate
  ×1/×2/×4, ``--hold tokens``.
* Capacity is sized as the grid sizes it: a share of the *cut trace's* distinct blocks (at least its
  largest request), so a longer cut has a larger pool; the ceiling (one pool with N× capacity) is
  replayed on the same cut. A longer cut is therefore more of the same traffic against a pool
  grown with it, not the same pool for longer.
* Routers: the grid's baselines (random, round-robin, session, Dynamo's cost), ``kv-aware`` (the
  fixed defaults) and ``kv-adaptive, fading forgive`` (``families.FADING``: the best self-tuning row over the
  whole grid at 300 requests when it was chosen).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, write_section  # noqa: E402
from bench.routing import families  # noqa: E402
from bench.routing.verdicts import judge, met  # noqa: E402

LENGTHS = (300, 2000)  # every family has more than 2,000 requests (chat-long, the fewest: 2,251)
REPLICAS, SHARES, HOSTS, RATES = families.REPLICAS, families.SHARES, families.HOSTS, families.RATES
ROUTED = ("kv-aware", families.FADING[0])
PLOT = ROOT / "docs" / "img" / "routing_trace_length.png"


def run(name: str, requests: int, replicas: int, share: float, host: int, rate: int) -> dict:
    """One setting at one trace length: the grid's routers, the fading row, and the verdicts."""
    if len(families.load(name, requests)) < requests:  # a short family would be replayed whole, mislabelled
        raise ValueError(f"{name} has fewer than {requests} requests")
    gpu = families.gpu_blocks(name, requests, share)
    row = families.run_setting(name, requests, replicas, gpu, host, rate)
    row[families.FADING[0]] = families.run_extra("kv-adaptive", {}, families.FADING[1], name, requests, replicas, gpu,
                                                  host, rate)
    out = {"family": name, "requests": requests, "replicas": replicas, "share": share, "host": host, "rate": rate,
           "gpu": gpu, **row}
    out["verdicts"] = {label: judge(row, label) for label in ROUTED}
    return out


def from_grid(names: list[str], roles: dict[str, str], cache: Path, workers: int) -> list[dict]:
    """The settings at the grid's cut, from its cache (``families.replay``; the fading row by ``replay_extras``)."""
    grid = argparse.Namespace(only=",".join(names), requests=families.REQUESTS, workers=workers, cache=cache, routers="")
    rows, _ = families.replay(roles, grid)
    families.replay_extras(rows, grid, {families.FADING[0]: families.EXTRAS[families.FADING[0]]})
    out = []
    for g in rows:
        row = {k: g[k] for k in ("ceiling", "ceiling_hit_tokens", "keyed", *families.ROUTERS, families.FADING[0])}
        out.append({"family": g["family"], "requests": families.REQUESTS, "replicas": g["replicas"], "share": g["share"],
                    "host": g["host"], "rate": g["rate"], "gpu": g["gpu_blocks"], **row,
                    "verdicts": {label: judge(row, label) for label in ROUTED}})
    return out


def _key(r: dict) -> tuple:
    return r["family"], r["replicas"], r["share"], r["host"], r["rate"]


def counts(rows: list[dict], label: str) -> dict:
    verdicts = [r["verdicts"][label] for r in rows]
    return {
        "settings": len(rows),
        "imbalance": sum(v["ok_imbalance"] for v in verdicts),
        "all": sum(met(v) for v in verdicts),
        "worst": max(r[label]["imbalance"] for r in rows),
    }


def section(rows: list[dict], roles: dict[str, str], lengths: tuple[int, ...], seconds: float,
            from_cache: int = 0) -> str:
    fams = list(dict.fromkeys(r["family"] for r in rows))
    first, last = lengths[0], lengths[-1]
    lines = [
        "## Routing targets against trace length (`bench/routing/trace_length.py`)",
        "",
        seed_line(families.SEED, "every generated family's `generate(seed)`, as in the family grid"),
        "",
        f"The family grid (`bench/routing/families.py`; its cut: the first {families.REQUESTS} requests, first run and "
        "its self-tuning knobs chosen at 300) measures load imbalance as max / mean prefill tokens per replica over "
        f"the whole cut trace. This replays the grid's {len(REPLICAS) * len(SHARES) * len(HOSTS) * len(RATES)} settings per family "
        f"({'/'.join(map(str, REPLICAS))} replicas × {'/'.join(f'{s:.0%}' for s in SHARES)} GPU × host 0 / 4× × "
        f"rate {'/'.join(f'×{r}' for r in RATES)}) at trace lengths {', '.join(map(str, lengths))}, with the grid's "
        "own replay and verdict code (targets: ≥ 90 % of one pool with N× capacity, ≥ the best baseline within half "
        "a point, imbalance ≤ 1.3). GPU blocks are a share of the cut trace's distinct blocks, so a longer cut has a "
        f"larger pool: more of the same traffic against a pool grown with it. {len(rows)} setting × length runs (each "
        f"replays every router of its setting) in {seconds:.0f} s ({machine()})"
        + (f"; the {from_cache} at the grid's own cut are the grid's replays, read from its cache." if from_cache else "."),
        "",
        f"| family | role | settings | router | all three at {first} | at {last} | imbalance ≤ 1.3 at {first} "
        f"| at {last} | worst imbalance at {first} | at {last} | random's worst imbalance at {first} | at {last} |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    totals = {(label, n): {"all": 0, "imbalance": 0, "settings": 0} for label in ROUTED for n in (first, last)}
    for fam in fams:
        for label in ROUTED:
            per = {}
            for n in (first, last):
                sub = [r for r in rows if r["family"] == fam and r["requests"] == n]
                per[n] = counts(sub, label)
                per[n]["random"] = max(r["random"]["imbalance"] for r in sub)
                for key in ("all", "imbalance", "settings"):
                    totals[(label, n)][key] += per[n][key]
            a, b = per[first], per[last]
            lines.append(f"| {fam} | {roles.get(fam, '?')} | {a['settings']} | {label} | {a['all']} | {b['all']} | "
                         f"{a['imbalance']} | {b['imbalance']} | {a['worst']:.2f} | {b['worst']:.2f} | "
                         f"{a['random']:.2f} | {b['random']:.2f} |")
    for label in ROUTED:
        a, b = totals[(label, first)], totals[(label, last)]
        lines.append(f"| **total** | | {a['settings']} | {label} | {a['all']} | {b['all']} | {a['imbalance']} | "
                     f"{b['imbalance']} | | | | |")
    lines += ["", "Median load imbalance over every family's settings, by replica count and trace length:", "",
              "| replicas | router | " + " | ".join(f"at {n}" for n in lengths) + " |",
              "|---:|---|" + "---:|" * len(lengths)]
    for replicas in REPLICAS:
        for label in ("random", "session", *ROUTED):
            med = [statistics.median(r[label]["imbalance"] for r in rows
                                     if r["replicas"] == replicas and r["requests"] == n) for n in lengths]
            lines.append(f"| {replicas} | {label} | " + " | ".join(f"{m:.2f}" for m in med) + " |")
    lines += ["", *reading(rows, first, last), "",
              "![kv-aware's load imbalance at each trace length against the shortest cut's, every setting]"
              "(img/routing_trace_length.png)"]
    return "\n".join(lines)


def reading(rows: list[dict], first: int, last: int) -> list[str]:
    """What the table says, computed: the imbalance misses at the short cut that the long one clears."""
    out = []
    short = {_key(r): r for r in rows if r["requests"] == first}
    long_ = {_key(r): r for r in rows if r["requests"] == last}
    for label in ROUTED:
        missed = [k for k, r in short.items() if not r["verdicts"][label]["ok_imbalance"]]
        cleared = [k for k in missed if k in long_ and long_[k]["verdicts"][label]["ok_imbalance"]]
        new = [k for k, r in long_.items() if not r["verdicts"][label]["ok_imbalance"]
               and k in short and short[k]["verdicts"][label]["ok_imbalance"]]
        out.append(f"* **{label}**: above 1.3 imbalance in {len(missed)} of {len(short)} settings at {first} "
                   f"requests, of which {len(cleared)} within it at {last}; above it at {last} but not at {first}: "
                   f"{len(new)}.")
    random_short = sum(r["random"]["imbalance"] > 1.3 for r in short.values())
    random_long = sum(r["random"]["imbalance"] > 1.3 for r in long_.values())
    out.append(f"* **random** (balanced in expectation): above 1.3 in {random_short} settings at {first}, "
               f"{random_long} at {last}.")
    return out


def plot(rows: list[dict], first: int, lengths: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths) - 1, figsize=(5.5 * (len(lengths) - 1), 4.5), squeeze=False)
    short = {_key(r): r for r in rows if r["requests"] == first}
    for ax, n in zip(axes[0], lengths[1:]):
        for replicas, color in zip(REPLICAS, ("C0", "C1", "C3")):
            pairs = [(short[k][ROUTED[0]]["imbalance"], r[ROUTED[0]]["imbalance"]) for r in rows
                     if r["requests"] == n and r["replicas"] == replicas
                     and (k := _key(r)) in short]
            ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=14, c=color, label=f"{replicas} replicas")
        ax.axhline(1.3, color="k", lw=0.6, ls="--")
        ax.axvline(1.3, color="k", lw=0.6, ls="--")
        ax.plot([1, 2], [1, 2], color="0.6", lw=0.6)
        ax.set_xlim(1.0, 1.8)
        ax.set_ylim(1.0, 1.8)
        ax.set_xlabel(f"kv-aware load imbalance, first {first} requests")
        ax.set_ylabel(f"kv-aware load imbalance, first {n} requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", default=",".join(map(str, LENGTHS)),
                        help="comma-separated trace lengths, shortest first (default: %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated families (a subset is printed, never written)")
    parser.add_argument("--cache", type=Path,
                        help=f"the families grid's cache (families.py --cache): the cut of {families.REQUESTS} requests "
                             "is read from it, replayed only where missing")
    args = parser.parse_args()
    try:
        lengths = tuple(sorted({int(x) for x in args.requests.split(",") if x.strip()}))
    except ValueError:
        parser.error(f"--requests: comma-separated integers, got {args.requests!r}")
    if len(lengths) < 2 or lengths[0] < 10:
        parser.error("--requests: at least two trace lengths, each of 10 requests or more")
    roles = families.workloads()
    names = [n for n in roles if not args.only or n in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - set(roles)
    if unknown:
        parser.error(f"unknown families {', '.join(sorted(unknown))}; known: {', '.join(roles)}")
    if args.only:
        args.no_write = True
    began = time.perf_counter()
    rows = []
    if args.cache is not None and families.REQUESTS in lengths:
        rows += from_grid(names, roles, args.cache, args.workers)
    replayed = {r["requests"] for r in rows}
    jobs = [(n, k, r, s, h, a) for n in names for k in lengths if k not in replayed for r in REPLICAS for s in SHARES
            for h in HOSTS for a in RATES]
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = [pool.submit(run, *job) for job in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            rows.append(future.result())
            print(f"[{done}/{len(jobs)}] {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (names.index(r["family"]), r["requests"], r["replicas"], r["share"], r["host"], r["rate"]))
    text = section(rows, roles, lengths, time.perf_counter() - began,
                   sum(r["requests"] == families.REQUESTS for r in rows) if replayed else 0)
    print(text)
    if not args.no_write:
        plot(rows, lengths[0], lengths)
        write_section("routing_trace_length", text)
        print("wrote docs/benchmarks.md section bench:routing_trace_length and docs/img/routing_trace_length.png")


if __name__ == "__main__":
    main()
