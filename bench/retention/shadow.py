"""Sampled shadow pools: accuracy against full replays, and the selection's cost per request.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/shadow.py [--no-write] [--sections cost accuracy] [--scaled-copies N]``

Writes ``bench:shadow_accuracy`` and ``bench:selection_cost`` in docs/benchmarks.md.

1. Accuracy (the target: a 1 % sample within 2 points of a full replay at each
   capacity): the public synthetic trace, GPU 1/2/5/10 % of its distinct blocks, GPU only
   (TensorRT-LLM defaults = LRU) and with a 4× host tier; samples of 1, 5 and 10 % of the
   hash space, five disjoint slices each (``HashSample(rate, start)``), error of each
   slice's estimate in points and the interval it states (± 2 jackknife standard errors);
   the full replays are the truth. Then 1 % slices on ``--scaled-copies`` copies of the trace
   (the same traffic at that many times the volume), against full replays of the copies.
2. Cost: per-request wall time of the gateway's planning step on the same trace (pool of 2 %
   GPU + 4× host): the static class plan alone, adaptive's bands alone (plan + statistics),
   and adaptive with selection (bands + static + two shadows) at 1 / 5 / 10 % sampling;
   median, p99 and max over the trace's requests, side by side in one run, and the shadows'
   size. A miss-ratio curve of four capacities at 1 % for comparison.
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

from bench.report import machine, publish, seed_line, write_section  # noqa: E402
from retention.policy.adaptive import AdaptiveConfig, ReuseStats, adaptive_plan  # noqa: E402
from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention  # noqa: E402
from retention.policy.selection import AdaptiveSelector  # noqa: E402
from retention.shadow import HashSample, MissRatioCurve, ShadowPool  # noqa: E402
from retention.shadow.duel import DuelConfig  # noqa: E402
from retention.simulation.sim_policies import make_policy  # noqa: E402
from retention.simulation.simulator import SimConfig, request_hashes, simulate  # noqa: E402
from retention.trace import distinct_blocks, parse_trace  # noqa: E402

from bench.retention.generalize import TRACE  # noqa: E402
FRACTIONS = (0.01, 0.02, 0.05, 0.10)
RATES = (0.01, 0.05, 0.10)
STARTS = (0.0, 0.2, 0.4, 0.6, 0.8)
CLASS = RetentionClassSpec(SegmentRetention(35), SegmentRetention(35), SegmentRetention(35), SegmentRetention(35))


def _replay_slices(requests, hashes, caps, rate: float, host: int, starts) -> list[list[tuple[float, float]]]:  # noqa: ANN001
    """Per capacity, per slice: (estimate, jackknife stderr) of a shadow pool on that slice."""
    per_cap: list[list[tuple[float, float]]] = [[] for _ in caps]
    for start in starts:
        sample = HashSample(rate, start)
        pools = [ShadowPool(sample, c, host * c) for c in caps]
        for request, h in zip(requests, hashes, strict=True):
            kept = sample.indices(h)
            for pool in pools:
                pool.observe(h, now=request.timestamp_ms / 1000.0, num_tokens=request.input_length,
                             tokens_per_block=512, kept=kept)
        for k, pool in enumerate(pools):
            per_cap[k].append((pool.counts.hit_rate(), pool.counts.hit_rate_stderr()))
    return per_cap


def _truth(requests, hashes, caps) -> dict[int, list[float]]:  # noqa: ANN001
    return {
        0: [simulate(requests, make_policy("lru"), primary_blocks=c, secondary_blocks=0, hashes=hashes).hit_rate
            for c in caps],
        4: [simulate(requests, make_policy("trtllm-default"), primary_blocks=c, secondary_blocks=4 * c,
                     hashes=hashes).hit_rate for c in caps],
    }


def _table(requests, hashes, distinct: int, rates, starts) -> tuple[list[str], list, int, int]:  # noqa: ANN001
    """Markdown rows, the settings beyond 2 points, and the jackknife interval's coverage (hits, cases)."""
    caps = [round(distinct * f) for f in FRACTIONS]
    truth = _truth(requests, hashes, caps)
    rows, verdict, covered, cases = [], [], 0, 0
    for rate in rates:
        for host in (0, 4):
            per_cap = _replay_slices(requests, hashes, caps, rate, host, starts)
            cells = []
            for k in range(len(caps)):
                errs = [100 * (est - truth[host][k]) for est, _ in per_cap[k]]
                halves = [200 * se for _, se in per_cap[k]]
                covered += sum(abs(e) <= w for e, w in zip(errs, halves, strict=True))
                cases += len(errs)
                worst = max(abs(e) for e in errs)
                cells.append(f"{worst:.1f} ({statistics.mean(errs):+.1f}) ±{statistics.mean(halves):.1f} "
                             f"[{100 * truth[host][k]:.1f}]")
                if worst > 2.0:
                    verdict.append((rate, host, FRACTIONS[k], worst))
            rows.append(f"| {rate:.0%} | {host}× | " + " | ".join(cells) + " |")
    return rows, verdict, covered, cases


def scaled_trace(requests, copies: int) -> list:  # noqa: ANN001
    """``copies`` copies of the trace, each on its own hash ids and rotated in time by 1/copies of its span.

    The same traffic shape at ``copies`` × the volume (as ``copies`` × the tenants would send it):
    what a sampled estimate sees on a larger deployment, with a full replay to check it against.
    """
    span = max(r.timestamp_ms for r in requests) + 1.0
    offset = max(max(r.hash_ids, default=0) for r in requests) + 1
    out = []
    for k in range(copies):
        shift = k * span / copies
        out.extend(dataclasses.replace(r, timestamp_ms=(r.timestamp_ms + shift) % span,
                                       hash_ids=tuple(x + k * offset for x in r.hash_ids)) for r in requests)
    out.sort(key=lambda r: r.timestamp_ms)
    return [dataclasses.replace(r, index=i) for i, r in enumerate(out)]


def accuracy(requests, hashes, distinct: int, *, scaled_copies: int) -> str:  # noqa: ANN001
    rows, verdict, covered, cases = _table(requests, hashes, distinct, RATES, STARTS)
    header = ["| sample | host | " + " | ".join(f"GPU {f:.0%}" for f in FRACTIONS) + " |",
              "|---|---|" + "---:|" * len(FRACTIONS)]
    lines = [
        "## Shadow pools: accuracy (bench/retention/shadow.py)",
        "",
        seed_line(None, "the public synthetic trace as it is; samples are fixed slices of the hash space"),
        "",
        f"Synthetic trace ({len(requests):,} requests, {distinct:,} distinct blocks), `--hold none`. Estimate of a",
        "sampled shadow pool (retention/shadow/: the real BlockPool on the blocks whose hash falls in a slice of",
        "the hash space, capacity × rate) minus the full replay's hit rate, in points, for five disjoint slices:",
        "max |error| (mean error) ±mean stated half-width (2 × the estimate's own jackknife standard error)",
        "[full replay's hit rate]. Full replay: lru (GPU only) and trtllm-default (host 4×).",
        "",
        *header,
        *rows,
    ]
    failing = sorted({r for r, _, _, _ in verdict})
    ok = [r for r in RATES if r not in failing]
    lines += [
        "",
        "Reading: " + (
            f"slices of {', '.join(f'{r:.0%}' for r in failing)} miss 2 points somewhere "
            f"({'; '.join(f'{r:.0%} host {h}× GPU {f:.0%}: {w:.1f}' for r, h, f, w in verdict[:6])}); "
            if verdict else "every slice is within 2 points; "
        ) + (f"{', '.join(f'{r:.0%}' for r in ok)} meet 2 points in every slice and setting. " if ok else "")
        + f"The stated interval (estimate ± 2 standard errors) holds the full replay in {covered} of {cases} cases,",
        "and at 1 % it grows with capacity to ±5 points: the trace has only 44 k distinct blocks, so a 1 % slice holds ~440",
        "of them (4–44 shadow GPU blocks), and which hot blocks fall in it moves the estimate by points. The",
        "error shrinks with the number of sampled distinct blocks, not with the rate; see the scaled run below.",
    ]
    if scaled_copies > 1:
        big = scaled_trace(requests, scaled_copies)
        big_hashes = request_hashes(big, SimConfig())
        big_distinct = distinct_blocks(big)
        rows, verdict, covered, cases = _table(big, big_hashes, big_distinct, (0.01,), STARTS)
        lines += [
            "",
            f"### The same traffic at {scaled_copies}× the volume",
            "",
            f"{scaled_copies} copies of the synthetic trace, each on its own hash ids and rotated in time by "
            f"1/{scaled_copies} of the span",
            f"({len(big):,} requests, {big_distinct:,} distinct blocks: what {scaled_copies}× the tenants would "
            "send), same capacities as shares of its",
            "distinct blocks, 1 % slices, same columns:",
            "",
            *header,
            *rows,
            "",
            "Reading: " + ("every slice is within 2 points at 1 %" if not verdict else
                           "at 1 %, " + "; ".join(f"host {h}× GPU {f:.0%}: {w:.1f}" for _, h, f, w in verdict)
                           + " points off")
            + f"; the stated interval holds the full replay in {covered} of {cases} cases.",
        ]
    return "\n".join(lines)


def cost(requests, hashes, distinct: int) -> str:  # noqa: ANN001
    gpu = round(distinct * 0.02)
    host = 4 * gpu

    def timed(step) -> list[float]:  # noqa: ANN001
        out = []
        for request, h in zip(requests, hashes, strict=True):
            started = time.perf_counter_ns()
            step(request, h)
            out.append((time.perf_counter_ns() - started) / 1000.0)
        return out

    def static_step(request, h) -> None:  # noqa: ANN001
        n = request.input_length
        plan_retention(CLASS, Segments(0, n, n), offload_min_priority=30)

    stats = ReuseStats(AdaptiveConfig())

    def bands_step(request, h) -> None:  # noqa: ANN001
        n = request.input_length
        plan_retention(CLASS, Segments(0, n, n), offload_min_priority=30)
        adaptive_plan(stats, None, h, num_tokens=n, tokens_per_block=512, offload_min_priority=30, host_tier=True)
        stats.observe(None, h, request.timestamp_ms / 1000.0, num_blocks=-(-n // 512))

    runs = {"static class plan": timed(static_step), "bands (plan + statistics)": timed(bands_step)}
    sizes = {}
    for rate in RATES:
        selector = AdaptiveSelector(gpu, host, 30, duel_config=DuelConfig(rate=rate, min_shadow_blocks=0))

        def select_step(request, h, selector=selector) -> None:  # noqa: ANN001
            n = request.input_length
            static = plan_retention(CLASS, Segments(0, n, n), offload_min_priority=30)
            selector.plan(tenant=None, hashes=h, num_tokens=n, tokens_per_block=512, static=static,
                          now=request.timestamp_ms / 1000.0)

        runs[f"adaptive with selection, {rate:.0%} shadows"] = timed(select_step)
        shadow = selector.duel.shadows[0].pool.config
        sizes[rate] = (shadow.primary_blocks, shadow.secondary_blocks, len(selector.duel.shadows))
    # A GPU-only pool duels three candidates (static, bands, protect: retention/policy/selection.py).
    gpu_only = AdaptiveSelector(gpu, 0, 30, duel_config=DuelConfig(rate=0.01, min_shadow_blocks=0))

    def gpu_only_step(request, h) -> None:  # noqa: ANN001
        n = request.input_length
        static = plan_retention(CLASS, Segments(0, n, n), offload_min_priority=30)
        gpu_only.plan(tenant=None, hashes=h, num_tokens=n, tokens_per_block=512, static=static,
                      now=request.timestamp_ms / 1000.0)

    runs[f"adaptive with selection, GPU only ({', '.join(gpu_only.names)}), 1 % shadows"] = timed(gpu_only_step)
    curve = MissRatioCurve([round(distinct * f) for f in FRACTIONS], rate=0.01, host_blocks=lambda c: 4 * c)

    def curve_step(request, h) -> None:  # noqa: ANN001
        curve.observe(h, now=request.timestamp_ms / 1000.0, num_tokens=request.input_length, tokens_per_block=512)

    runs["miss-ratio curve, 4 capacities, 1 %"] = timed(curve_step)
    base = statistics.median(runs["bands (plan + statistics)"])
    blocks = [len(h) for h in hashes]
    lines = [
        "## Selection: cost per request (bench/retention/shadow.py)",
        "",
        seed_line(None, "the public synthetic trace as it is; samples are fixed slices of the hash space"),
        "",
        f"Per-request wall time on the synthetic trace ({len(requests):,} requests, median {statistics.median(blocks):.0f} and",
        f"max {max(blocks)} full 512-token blocks each), hashes precomputed (the gateway hashes once for the",
        f"statistics anyway); pool 2 % GPU ({gpu} blocks) + 4× host. One run, side by side ({machine()}, shared).",
        "",
        "| step | median µs | p99 µs | max µs | median / bands |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, samples in runs.items():
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        lines.append(f"| {name} | {statistics.median(samples):.0f} | {p99:.0f} | {ordered[-1]:.0f} | "
                     f"{statistics.median(samples) / base:.2f} |")
    lines += [
        "",
        "Shadow size per candidate (GPU + host blocks of the inner pool; two candidates with a host tier): "
        + ", ".join(f"{r:.0%}: {p} + {s}" for r, (p, s, _) in sizes.items()) + ".",
        "Bound: per request one pass over the hashes plus, when a block is sampled, every candidate's plan",
        "(O(blocks)) and a shadow replay of the sampled blocks per candidate (one SHA-256 and O(1) list work",
        "each); a request's work is O(blocks × (1 + candidates × rate)), and memory is the shadows plus a few",
        f"floats per tenant. The p99/max columns are dominated by the shared machine's scheduling (the static",
        "plan, a few µs of work, shows the same tail) and by the longest prompts; compare the medians.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--sections", nargs="+", choices=("cost", "accuracy"), default=["cost", "accuracy"])
    parser.add_argument("--scaled-copies", type=int, default=10,
                        help="also check 1 %% slices on this many copies of the trace (1 = skip)")
    args = parser.parse_args()
    with TRACE.open() as handle:
        requests = parse_trace(handle)
    hashes = request_hashes(requests, SimConfig())
    distinct = distinct_blocks(requests)
    if "cost" in args.sections:
        cost_text = cost(requests, hashes, distinct)
        print(cost_text, flush=True)
        if not args.no_write:
            write_section("selection_cost", cost_text)
            print("wrote docs/benchmarks.md section bench:selection_cost")
    if "accuracy" in args.sections:
        accuracy_text = accuracy(requests, hashes, distinct, scaled_copies=args.scaled_copies)
        publish("shadow_accuracy", accuracy_text, write=not args.no_write)


if __name__ == "__main__":
    main()
