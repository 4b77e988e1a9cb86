"""bench:mrc — what the gateway's online miss-ratio curves cost per request.

Replays the public synthetic trace (Mooncake, 512-token blocks; tokens synthesised as the
simulator does) through ``server.gateway.observe.miss_ratio.PoolCurve`` — the six shadow points a
pool with a host tier gets — at several sampling rates, side by side in one run with the
block hashing the gateway already does for adaptive retention (the curves reuse those
hashes). Pool: 2 % of the trace's distinct blocks on GPU, 4x that on host (the simulator's
standard setting). Reports CPU µs per request (total over the trace / requests; median of
three passes), the ratio to hashing, the shadow blocks held (memory bound), and the 1x point's
estimate against the rate-1.0 curve (what sampling costs in accuracy on this trace).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/server/mrc.py`` (writes docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, synthetic_trace, write_section  # noqa: E402
from retention.hashing import block_hashes  # noqa: E402
from retention.trace import distinct_blocks, parse_trace, request_tokens  # noqa: E402
from retention.types import DEFAULT_PLAN  # noqa: E402
from server.gateway.observe.miss_ratio import PoolCurve  # noqa: E402
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot  # noqa: E402

TRACE = synthetic_trace()
BLOCK = 512
RATES = (0.01, 0.05, 0.2, 1.0)


def _pool(primary: int, secondary: int) -> PoolSnapshot:
    return PoolSnapshot(id=1, name="bench", model_name="m", triton_model="kvgate_llm", engine_spec="s",
                        tokens_per_block=BLOCK, primary_blocks=primary, secondary_blocks=secondary,
                        secondary_offload_min_priority=30,
                        replicas=(ReplicaSnapshot(id=1, name="r0", endpoint="h:1", state="active", weight=1),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    requests = parse_trace(TRACE.read_text().splitlines(), block_size=BLOCK)
    tokens = [request_tokens(r, BLOCK) for r in requests]
    primary = max(1, round(0.02 * distinct_blocks(requests)))
    pool = _pool(primary, 4 * primary)

    def hash_pass() -> tuple[float, list[list[int]]]:
        start = time.process_time()
        out = [block_hashes(t, BLOCK) for t in tokens]
        return time.process_time() - start, out

    hash_times, hashes = [], []
    for _ in range(3):
        elapsed, hashes = hash_pass()
        hash_times.append(elapsed)
    hash_us = statistics.median(hash_times) / len(requests) * 1e6

    rows, estimates, stated = [], {}, {}
    for rate in RATES:
        times, curve = [], None
        for _ in range(3):
            curve = PoolCurve.build(pool, rate)
            start = time.process_time()
            for r, h, t in zip(requests, hashes, tokens):
                curve.observe(h, DEFAULT_PLAN, now=r.timestamp_ms / 1000, num_tokens=len(t), tokens_per_block=BLOCK,
                              tenant=r.tenant)
            times.append(time.process_time() - start)
        us = statistics.median(times) / len(requests) * 1e6
        held = sum(p.shadow.pool.config.primary_blocks + p.shadow.pool.config.secondary_blocks for p in curve.points)
        estimates[rate] = {(p.gpu, p.host): p.shadow.counts.hit_rate() or 0.0 for p in curve.points}
        stated[rate] = {(p.gpu, p.host): 2 * (p.shadow.counts.hit_rate_stderr() or 0.0) for p in curve.points}
        rows.append((rate, curve.sample.rate, us, us / hash_us, held))

    full = estimates[1.0]
    lines = [
        "## Online miss-ratio curves: cost per request (`bench/server/mrc.py`)",
        "",
        seed_line(None, "the public synthetic trace as it is; shadow samples are fixed slices of the hash space"),
        "",
        f"Synthetic trace, {len(requests):,} requests, pool {primary} GPU + {4 * primary} host blocks of {BLOCK} tokens "
        f"(2 % / 8 % of distinct blocks); six shadow points per pool (GPU 0.5/1/2/4x, host 0/2x). {machine()}. "
        "CPU time per request, median of three passes; the gateway hashes each prompt once and shares "
        "the hashes with adaptive retention and the curves.",
        "",
        f"Hashing the prompt's blocks (what the curves reuse): **{hash_us:.1f} µs** per request.",
        "",
        "| sampling rate (set → used) | curves µs / request | × hashing | shadow blocks held | 1x point estimate (± stated) | rate-1.0 value | error (points) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, used, us, ratio, held in rows:
        est, ref = estimates[rate][("1x", "1x")], full[("1x", "1x")]
        lines.append(f"| {rate:g} → {used:.3g} | {us:.1f} | {ratio:.2f} | {held:,} | {est:.1%} (± {stated[rate][('1x', '1x')] * 100:.1f}) | {ref:.1%} | {abs(est - ref) * 100:.2f} |")
    lines += ["", "± stated: 2 × the point's own jackknife standard error (`kvgate_mrc_hit_rate_stderr`), in points. "
              "*Used*: the rate a curve samples at, the set rate raised for a pool too small to give its smallest "
              "point 16 sampled blocks (`miss_ratio.curve_rate`).",
              "", "Every point at each rate against rate 1.0 (points of hit rate):", "",
              "| point (GPU / host) | " + " | ".join(f"{r:g}" for r in RATES[:-1]) + " | rate 1.0 |",
              "|---|" + "---:|" * len(RATES)]
    for key in full:
        cells = " | ".join(f"{(estimates[r][key] - full[key]) * 100:+.2f}" if key in estimates[r] else "—"
                           for r in RATES[:-1])
        lines.append(f"| {key[0]} / {key[1]} | {cells} | {full[key]:.1%} |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("mrc", body)


if __name__ == "__main__":
    main()
