"""Recommendations from a trace: a host tier size and per-segment retention durations.

* **Host tier size**: the trace is replayed by the real simulator (``retention/simulator``,
  the pool code the engine runs) with TensorRT-LLM's defaults (every block at priority
  35 >= the code-default offload threshold 30, so every GPU victim goes to host) at a
  fixed GPU capacity and several host sizes. The recommendation is the knee of the
  hit-rate curve (Kneedle: the point farthest above the chord after scaling both axes
  to [0, 1]); when the largest host tier adds less than ``MIN_GAIN`` to the hit rate, it
  is 0 (a host tier would buy nothing measurable). The knee counts as the bend of the
  curve (``saturated: true``) only if the curve has flattened after it; otherwise the
  recommendation is the largest size, flagged ``saturated: false`` (a lower bound: measure
  larger sizes). Not saturated when any of these holds:

  1. no point lies ``MIN_BEND`` above the chord (a straight or accelerating curve);
  2. the last segment still gains at least ``MIN_TAIL_SLOPE`` (half) of the chord's average
     gain per block (first to last point): a concave curve that has bent flattens well below
     its average slope, one still rising at the largest size does not;
  3. the knee holds less than ``MIN_KNEE_SHARE`` (half) of the gain at the largest size: most
     of the largest gain measured (at the largest size, on an increasing curve): most of
     what a host tier buys lies past the knee (a late second rise, as on S-shaped curves).
* **Durations**: a segment's blocks should outlive the gap to their next use; the
  recommendation is the ``percentile``-th reuse gap of the segment rounded up to two
  significant digits (so ``percentile`` % of the observed reuses would still find the
  block), and none when the segment was reused fewer than ``MIN_REUSES`` times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retention.simulation.capacity import MAX_DISTINCT_MULTIPLE, CapacityError, parse_capacity
from server.analysis.trace_file import trace_lines

MIN_GAIN = 0.005  # half a point of hit rate
MIN_BEND = 0.05  # the knee must lie this far above the chord (both axes scaled to [0, 1])
MIN_TAIL_SLOPE = 0.5  # a last segment this steep (x the chord's mean gain per block) is still rising
MIN_KNEE_SHARE = 0.5  # a knee must hold this share of the gain at the largest size
MIN_REUSES = 20
MIN_HEADROOM = 0.01  # one point of hit rate: a replayed policy's gain over LRU worth a class change
CANDIDATES = ("adaptive", "protect")  # replayed GPU only next to TensorRT-LLM's defaults (= LRU there)
DEFAULT_HOST_MULTIPLES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def knee(xs: Sequence[float], ys: Sequence[float]) -> tuple[int, bool]:
    """(index of the knee, saturated) of an increasing curve (Kneedle, no smoothing).

    ``xs`` ascending. A flat curve (gain below ``MIN_GAIN``) gives (0, True): more host
    buys nothing. Otherwise the Kneedle point ``k`` is returned as (k, True) only when the
    curve has bent there and flattened after it; it gives (last, False), "at least this
    much; measure larger sizes", when the curve never rises ``MIN_BEND`` above its chord,
    when its last segment still gains ``MIN_TAIL_SLOPE`` x the chord's mean gain per block
    or more, or when the knee holds less than ``MIN_KNEE_SHARE`` of the largest gain
    measured (the module docstring states the rule).
    """
    if len(xs) != len(ys) or not xs:
        raise ValueError("knee needs equal, non-empty xs and ys")
    top = max(range(len(ys)), key=lambda i: (ys[i], -i))
    gain = ys[top] - ys[0]
    if gain < MIN_GAIN or xs[-1] == xs[0]:
        return 0, True
    best, best_d = 0, -math.inf
    for i in range(top + 1):
        d = (ys[i] - ys[0]) / gain - (xs[i] - xs[0]) / (xs[top] - xs[0])
        if d > best_d + 1e-12:
            best, best_d = i, d
    chord_slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    tail_slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])  # len >= 2 here: xs[-1] > xs[0]
    still_rising = chord_slope > 0 and tail_slope >= MIN_TAIL_SLOPE * chord_slope
    if best_d < MIN_BEND or still_rising or ys[best] - ys[0] < MIN_KNEE_SHARE * gain:
        return len(xs) - 1, False
    return best, True


def round_up_2sig(value: float) -> float:
    """Round up to two significant digits: 281.7 -> 290, 0.0123 -> 0.013."""
    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(round(value / scale, 9)) * scale


def durations(gaps: list[dict[str, Any]], *, percentile: float = 90.0) -> list[dict[str, Any]]:
    """Per (tenant, segment) row of ``reuse.reuse_gaps``: the recommended duration (ms) or None."""
    out = []
    points = len(gaps[0]["cdf_s"]) - 1 if gaps else 100
    for row in gaps:
        rec: dict[str, Any] = {"tenant": row["tenant"], "segment": row["segment"], "reuses": row["reuses"],
                               "percentile": percentile}
        if row["reuses"] < MIN_REUSES:
            rec.update(duration_ms=None, reason=f"only {row['reuses']} reuses (< {MIN_REUSES})")
        else:
            k = percentile / 100 * points
            lo, hi = math.floor(k), math.ceil(k)
            cdf = row["cdf_s"]
            gap = cdf[lo] + (cdf[hi] - cdf[lo]) * (k - lo)
            rec.update(gap_s=gap, duration_ms=int(round_up_2sig(gap * 1000)), reason=None)
        out.append(rec)
    return out


def host_curve(path: Path, *, block_size: int, gpu: str = "2%", multiples: Sequence[float] = DEFAULT_HOST_MULTIPLES,
               max_requests: int | None = 20_000, progress: Callable[[int], None] | None = None,
               on_total: Callable[[int], None] | None = None, stage: Callable[[str], None] | None = None,
               family: str | None = None) -> dict[str, Any]:
    """Hit rate at one GPU capacity and several host sizes (simulator), and the knee; then
    the retention headroom at that GPU capacity (:func:`retention_headroom`).

    ``gpu``: blocks (``"878"``) or a share of the replayed requests' distinct blocks
    (``"2%"``). Replays the first ``max_requests`` lines of the file (None = all).
    ``on_total`` receives the number of replayed requests (every replay, candidates included)
    before the first; ``progress`` advances as they are replayed; ``stage`` names the replay
    under way. ``family``: the generated family the trace comes from, if known (bound vs estimate).
    """
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig, request_hashes, simulate
    from retention.trace import distinct_blocks, parse_trace

    with trace_lines(path) as handle:  # plain or gzip, as DuckDB read it
        lines = handle if max_requests is None else itertools.islice(handle, max_requests)
        requests = parse_trace(lines, block_size=block_size)
    config = SimConfig(tokens_per_block=block_size, trace_block_size=block_size)
    distinct = distinct_blocks(requests)
    gpu_blocks = _capacity(gpu, distinct)
    # A host tier past what the trace can fill holds the same blocks and only costs memory (a
    # multiple of 1e300 reached the OOM killer): capped where everything fits many times over.
    cap = MAX_DISTINCT_MULTIPLE * max(1, distinct)
    hosts = sorted({round(min(gpu_blocks * m, cap)) for m in multiples})  # capped before rounding: 1e308 x GPU is inf
    if on_total is not None:
        on_total(len(requests) * (len(hosts) + len(CANDIDATES) + (0 not in hosts)))
    hashes = request_hashes(requests, config)
    points = []
    for host in hosts:
        result = simulate(requests, make_policy("trtllm-default"), primary_blocks=gpu_blocks, secondary_blocks=host,
                          config=config, hashes=hashes, progress=progress)
        points.append({"host_blocks": host, "hit_rate": result.hit_rate, "gpu_hit_rate": result.gpu_hit_rate,
                       "host_hit_rate": result.host_hit_rate})
    index, saturated = knee([p["host_blocks"] for p in points], [p["hit_rate"] for p in points])
    if stage is not None:
        stage(f"retention headroom: replaying {', '.join(CANDIDATES)} (GPU only)")
    retention = retention_headroom(requests, hashes, gpu_blocks, block_size, family=family, progress=progress,
                                   lru=next((p["hit_rate"] for p in points if p["host_blocks"] == 0), None))
    return {
        "requests_replayed": len(requests), "distinct_blocks": distinct, "gpu_blocks": gpu_blocks, "policy": "trtllm-default",
        "points": points, "knee_index": index, "saturated": saturated, "recommended_host_blocks": points[index]["host_blocks"],
        "gain_at_knee": points[index]["hit_rate"] - points[0]["hit_rate"],
        "gain_at_max": max(p["hit_rate"] for p in points) - points[0]["hit_rate"],
        "retention": retention,
    }


def retention_headroom(requests: Sequence[Any], hashes: Sequence[Sequence[int]], gpu_blocks: int, block_size: int,
                       *, lru: float | None = None, family: str | None = None,
                       progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """LRU, the candidate policies replayed, the age-based figure and Belady at ``gpu_blocks``
    (GPU only), and the verdict.

    The verdict rests on the replays (``CANDIDATES`` through the same simulator, pool and
    planner the gateway runs): the best replayed gain over LRU is what a policy *achieves*
    on this trace. The age-based figure (``age_based``) is a bound only where its condition
    holds (``age_based_kind`` from ``hit_density.ceiling_kind``: generated families with i.i.d.
    reuse gaps, ``family``); on a trace of unknown origin it is an estimate, which a policy
    reading more than age can pass, so ``headroom`` (what the report calls room for retention) is never below the best
    replayed gain. ``lru``: the GPU-only replay of TensorRT-LLM's defaults (which is LRU)
    when the caller has it, else it is replayed here. ``progress`` advances once per replayed
    request."""
    from retention.simulation.belady import belady, chain_request
    from retention.simulation.hit_density import AgeHulls, ceiling_kind
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig, simulate

    config = SimConfig(tokens_per_block=block_size, trace_block_size=block_size)

    def replay(name: str) -> float:
        return simulate(requests, make_policy(name), primary_blocks=gpu_blocks, secondary_blocks=0, config=config,
                        hashes=hashes, progress=progress).hit_rate

    if lru is None:
        lru = replay("trtllm-default")
    replayed = {"trtllm-default": lru, **{name: replay(name) for name in CANDIDATES}}
    best = max(replayed, key=lambda name: replayed[name])  # ties: the first, TensorRT-LLM's defaults
    gain = replayed[best] - lru
    chains = [chain_request(h, r.input_length, block_size) for h, r in zip(hashes, requests, strict=True)]
    optimum = belady(chains, gpu_blocks, block_size).hit_rate
    hulls = AgeHulls.build(chains, [r.timestamp_ms / 1000 for r in requests])
    ceiling = hulls.at(gpu_blocks, block_size).capped(optimum)
    ceiling = max(ceiling, lru)  # LRU is an age-based policy: the figure is never reported below it
    kind = ceiling_kind(family)
    return {"gpu_blocks": gpu_blocks, "lru": lru, "replayed": replayed, "best_policy": best, "best_gain": gain,
            "age_based": ceiling, "age_based_kind": kind, "belady": optimum,
            "headroom": max(gain, ceiling - lru), "verdict": verdict(lru, replayed, ceiling, kind)}


def verdict(lru: float, replayed: dict[str, float], ceiling: float, kind: str) -> str:
    """One sentence from the replays; the age-based figure is named as a bound or an estimate.

    Every difference shown is the difference of the rates shown (:func:`points_between`), so
    "+0.1 points (0.5% → 0.6%)" never reads "+0.0"; the decisions use the unrounded rates."""
    best = max(replayed, key=lambda name: replayed[name])
    gain, room = replayed[best] - lru, ceiling - lru
    measured = (f"`{best}` {points_between(lru, replayed[best]):+.1f} points over LRU "
                f"({100 * lru:.1f}% → {100 * replayed[best]:.1f}%)")
    if kind == "bound":
        age = (f"age-based policies could add at most {points_between(lru, ceiling):.1f} points "
               "(a bound: reuse gaps here are i.i.d.)")
    else:
        age = (f"the age-based figure, {points_between(lru, ceiling):+.1f} points, is an estimate on this trace, "
               "not a bound"
               + (f" (`{best}` passes it)" if gain > room else ""))
    if best == "trtllm-default":
        measured = f"no candidate beats LRU ({100 * lru:.1f}%)"
    else:
        measured = f"the best candidate is {measured}"
    if gain < MIN_HEADROOM:
        return (f"replayed at this GPU capacity, {measured}: retention adds under a point "
                f"here, size capacity (the host tier above) instead; {age}")
    return (f"replayed at this GPU capacity, {measured}: give tenants an adaptive class (mode adaptive, which "
            f"selects among these candidates online); {age}")


def points_between(before: float, after: float) -> float:
    """``after - before`` in points of hit rate, from the two rates as printed (one decimal of a
    percent): the gain a reader computes from the figures beside it. Never -0.0."""
    return round(100 * after, 1) - round(100 * before, 1) + 0.0


def _capacity(text: str, distinct: int) -> int:
    """``--gpu`` as ``kvgate simulate -c`` reads it (one parser for both commands)."""
    try:
        return parse_capacity(text, distinct)
    except (CapacityError, OverflowError) as exc:  # OverflowError: a share too large to round to a count
        raise ValueError(f"--gpu: {exc}") from None
