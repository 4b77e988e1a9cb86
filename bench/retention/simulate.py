"""Simulator evaluation: policies vs Belady on the Mooncake trace, and the noisy neighbour.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/simulate.py [--no-write] [--write-trace PATH]``

Writes two sections of docs/benchmarks.md (``bench:simulator``, ``bench:noisy_neighbour``)
and the plot docs/img/simulator_hit_rate.png. Deterministic: the same code and trace give
the same figures (the only wall-clock figure is the replay speed).

1. ``mooncake_synthetic_trace.jsonl`` at GPU capacities of 1, 2, 5, 10 % of its distinct
   blocks, without a host tier (``lru``, ``adaptive``) and with a host tier of 4× the GPU
   capacity (``trtllm-default``, ``adaptive``); Belady at the GPU capacity and at GPU + host.
   Oracle reference policies (``retention/simulation/oracle.py``: priority bands from perfect knowledge
   of each block's next use, or of its number of uses in the next W seconds, through the
   same pool) at every capacity, GPU only.
2. The noisy neighbour (``retention/workloads/noisy.py``): a premium tenant's hit rate alone,
   and next to a tenant flooding unique prompts at 10× its rate under ``lru``,
   ``adaptive``, classes, quotas, and classes + quotas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, write_section  # noqa: E402
from retention.simulation.oracle import oracle_factories  # noqa: E402
from retention.simulation.sim_policies import ClassMapping, make_policy  # noqa: E402
from retention.simulation.simulator import SimConfig, run_simulation, simulate  # noqa: E402
from retention.trace import distinct_blocks, parse_trace  # noqa: E402
from retention.workloads import NoisyNeighbourSpec, noisy_neighbour_trace  # noqa: E402

from bench.retention.generalize import TRACE  # noqa: E402
PLOT = ROOT / "docs" / "img" / "simulator_hit_rate.png"
FRACTIONS = (0.01, 0.02, 0.05, 0.10)
HORIZONS_S = (10.0, 30.0, 100.0, 300.0)  # oracle-reuse-within horizons
WINDOWS_S = (100.0, 300.0, 1000.0)  # oracle-popularity windows

PREMIUM_CLASS = {
    "system": {"priority": 90},
    "context": {"priority": 70, "duration_ms": 120_000},
    "turn": {"priority": 50, "duration_ms": 60_000},
    "decode": {"priority": 50},
}
STANDARD_CLASS = {s: {"priority": 35} for s in ("system", "context", "turn", "decode")}


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def mooncake_section(requests, distinct: int) -> tuple[str, list]:
    caps = [round(distinct * f) for f in FRACTIONS]
    started = time.perf_counter()
    oracle_names = [
        "oracle-reuse", *(f"oracle-reuse-within-{t:g}s" for t in HORIZONS_S), "oracle-next-use",
        *(f"oracle-popularity-{w:g}s" for w in WINDOWS_S),
    ]
    oracles = list(oracle_factories(oracle_names, requests).values())
    gpu_only = run_simulation(
        requests, [lambda: make_policy("lru"), lambda: make_policy("adaptive"), *oracles], caps,
        host_blocks=lambda c: 0,
    )
    with_host = run_simulation(
        requests, [lambda: make_policy("trtllm-default"), lambda: make_policy("adaptive")], caps,
        host_blocks=lambda c: 4 * c,
    )
    seconds = time.perf_counter() - started
    replays = len(caps) * (4 + len(oracles))
    host_verdict = "matches or beats" if all(
        rep.results["adaptive"].hit_rate >= rep.results["trtllm-default"].hit_rate for rep in with_host
    ) else "stays within {:.1f} points of".format(100 * max(
        rep.results["trtllm-default"].hit_rate - rep.results["adaptive"].hit_rate for rep in with_host))
    gains = [rep.results["adaptive"].hit_rate - rep.results["lru"].hit_rate for rep in gpu_only]
    gain_lo, gain_hi = 100 * min(gains), 100 * max(gains)
    at_2 = gpu_only[FRACTIONS.index(0.02)]
    share_2 = 100 * at_2.results["adaptive"].hit_rate / at_2.belady_gpu.hit_rate
    lru_share_2 = 100 * at_2.results["lru"].hit_rate / at_2.belady_gpu.hit_rate
    lines = [
        "## Simulator: Mooncake synthetic trace (bench/retention/simulate.py)",
        "",
        seed_line(None, "the public synthetic trace as it is"),
        "",
        f"`kvgate simulate` model, `--hold none`, 512-token blocks; {len(requests):,} requests, "
        f"{distinct:,} distinct blocks. Hit rate = prompt tokens served from cache / prompt tokens. "
        f"{replays} replays + Belady in {seconds:.0f} s ({machine()}, shared).",
        "",
        "Without a host tier (Belady = single-tier optimum at the GPU capacity):",
        "",
        "| GPU capacity | lru | adaptive | Belady | lru / Belady | adaptive / Belady |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for f, rep in zip(FRACTIONS, gpu_only, strict=True):
        lru, ada, bel = rep.results["lru"].hit_rate, rep.results["adaptive"].hit_rate, rep.belady_gpu.hit_rate
        lines.append(
            f"| {f:.0%} ({rep.primary_blocks:,} blocks) | {pct(lru)} | {pct(ada)} | {pct(bel)} | "
            f"{pct(lru / bel)} | {pct(ada / bel)} |"
        )
    within = [f"oracle-reuse-within-{t:g}s" for t in HORIZONS_S]
    lines += [
        "",
        "Oracle reference policies (GPU only, offline; `retention/simulation/oracle.py`): the same pool and",
        "mechanism as `adaptive` — predict reuse, set a priority band, LRU inside the band — but the",
        "prediction is *perfect*, read from the whole trace: `oracle-reuse` keeps blocks that will",
        "ever be used again, `within T` those used again within T seconds, `oracle-next-use` bands",
        "blocks by the time to their next use (≤ 10, 30, 100, 300, 1000 s, later). Read them as upper",
        "bounds for predictor-driven policies of that kind (caveat below). Hit rate (share of Belady):",
        "",
        "| GPU capacity | adaptive | oracle-reuse (ever again) | "
        + " | ".join(f"within {t:g} s" for t in HORIZONS_S)
        + " | oracle-next-use (6 bands) | Belady |",
        "|---|" + "---:|" * (4 + len(HORIZONS_S)),
    ]
    for f, rep in zip(FRACTIONS, gpu_only, strict=True):
        bel = rep.belady_gpu.hit_rate
        cells = [rep.results[n].hit_rate for n in ["adaptive", "oracle-reuse", *within, "oracle-next-use"]]
        lines.append(
            f"| {f:.0%} | " + " | ".join(f"{pct(x)} ({pct(x / bel)})" for x in cells) + f" | {pct(bel)} |"
        )
    popular = [f"oracle-popularity-{w:g}s" for w in WINDOWS_S]
    lines += [
        "",
        "Popularity oracles (GPU only, offline): priority = the *exact number* of times the block is",
        "used in the next W seconds (none = evicted first), LRU among equals. That is everything a",
        "frequency, recency or rate estimator could hope to learn about a block, and more (a count of",
        "0 also says \"not back within W\"). Hit rate (share of Belady):",
        "",
        "| GPU capacity | lru | adaptive | " + " | ".join(f"popularity {w:g} s" for w in WINDOWS_S) + " | Belady |",
        "|---|" + "---:|" * (3 + len(WINDOWS_S)),
    ]
    for f, rep in zip(FRACTIONS, gpu_only, strict=True):
        bel = rep.belady_gpu.hit_rate
        cells = [rep.results[n].hit_rate for n in ["lru", "adaptive", *popular]]
        lines.append(
            f"| {f:.0%} | " + " | ".join(f"{pct(x)} ({pct(x / bel)})" for x in cells) + f" | {pct(bel)} |"
        )
    lines += [
        "",
        "With a host tier of 4× the GPU capacity (hit rate = GPU + host; Belady at GPU + host blocks):",
        "",
        "| GPU capacity | trtllm-default (GPU / host) | adaptive (GPU / host) | Belady GPU+host | trtllm / Belady | adaptive / Belady | offloaded trtllm / adaptive |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for f, rep in zip(FRACTIONS, with_host, strict=True):
        trt, ada = rep.results["trtllm-default"], rep.results["adaptive"]
        bel = rep.belady_total.hit_rate if rep.belady_total else rep.belady_gpu.hit_rate
        lines.append(
            f"| {f:.0%} | {pct(trt.hit_rate)} ({pct(trt.gpu_hit_rate)} / {pct(trt.host_hit_rate)}) | "
            f"{pct(ada.hit_rate)} ({pct(ada.gpu_hit_rate)} / {pct(ada.host_hit_rate)}) | {pct(bel)} | "
            f"{pct(trt.hit_rate / bel)} | {pct(ada.hit_rate / bel)} | {trt.offloaded_blocks:,} / {ada.offloaded_blocks:,} |"
        )
    held = run_simulation(
        requests, [lambda: make_policy("lru"), lambda: make_policy("trtllm-default"), lambda: make_policy("adaptive")],
        [round(distinct * 0.02)], host_blocks=lambda c: 4 * c, config=SimConfig(hold="tokens"),
    )[0]
    lines += [
        "",
        "`--hold tokens` at 2 % (requests hold prompt + output blocks for (prompt − cached) / 8,000 tok/s +",
        "output / 40 tok/s; FIFO admission; host 4× for the policies that use one):",
        "",
        "| policy | hit rate (GPU / host) | requests that waited | offloaded | onboarded |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in held.results.items():
        lines.append(
            f"| {name} | {pct(r.hit_rate)} ({pct(r.gpu_hit_rate)} / {pct(r.host_hit_rate)}) | {r.delayed_requests:,} | "
            f"{r.offloaded_blocks:,} | {r.onboarded_blocks:,} |"
        )
    lines += [
        "",
        "Held blocks compete with the cache: GPU-only LRU falls to about 1 %, while a host tier keeps",
        "most of the reuse that concurrency pushes out of the GPU.",
        "",
        f"![hit rate vs GPU capacity]({PLOT.relative_to(ROOT / 'docs').as_posix()})",
        "",
        "`adaptive` is adaptive with selection (retention/policy/selection.py: TensorRT-LLM defaults or the bands below,",
        "whichever wins on sampled shadow pools; `-p adaptive-bands` runs the bands alone; every workload family",
        "in the `generalize` section).",
        "",
        f"Reading: `adaptive` is {'above' if gain_lo > 0 else 'at or above'} `lru` at every GPU-only capacity, by {gain_lo:.1f}–{gain_hi:.1f} points",
        f"({share_2:.1f} % of Belady at 2 %, lru {lru_share_2:.1f} %), but far from the target of 60 % of Belady at 2 %. The oracle rows say why that",
        "target is out of reach for an online policy on this trace.",
        "",
        "* The trace: 2,211 of its 3,993 requests open a new prompt; 1,803 of those prompts never",
        "  come back. The other 1,782 requests reuse an earlier prompt's prefix (median 34 blocks)",
        "  and add about one block. At 2 % the GPU holds about 8 s of new blocks under LRU, while a",
        "  prompt comes back after a median 55 s; LRU's hits are almost all returns within 10 s.",
        "  Belady also keeps returns after 10–100 s, but picks them with knowledge of the future.",
        "* Knowing *perfectly* whether a block will ever be used again — the question `adaptive`'s",
        "  statistics estimate — gives only 37–73 % of Belady (44 % at 2 %): many reused blocks come",
        "  back only after a small cache has turned over, and keeping them crowds out the ones that",
        "  return soon.",
        "* Knowing *perfectly how popular* every block will be over the next 5 or 17 minutes gives",
        "  53 % and 49 % of Belady at 2 % (popularity 300 s and 1000 s). No frequency, recency or",
        "  rate estimate can know more than that. Only a 100 s window passes 60 % (66 %), and it",
        "  works because it nearly tells *whether the block returns within 100 s*.",
        "* What pays is *when*. Knowing which blocks return within a horizon matched to the cache's",
        "  turnover (about 30 s at 1–2 %, 100 s at 5–10 %) reaches 64–80 % of Belady (71 % at 2 %).",
        "  Bands by the exact time to the next use reach 76–86 % (82 % at 2 %).",
        "* Online, that timing is barely predictable here. Per shared prefix, the log of the next",
        "  return gap correlates with the log of the previous gap at r = 0.32, and with the mean past",
        "  gap at r = 0.10. The best signals found (prior uses, last gap) put P(back within 30 s)",
        "  between 2 % and 58 %, far from the oracles' certainty.",
        "",
        "The oracles are measured ceilings for a perfect answer to each question with this band",
        "mechanism, not theorems; Belady is the only bound for every policy.",
        "",
        "`adaptive`'s bands (retention/policy/adaptive.py): measured one-shot traffic (p < 1 %) at 0, a block's",
        "first use at the offload threshold T, one prior use at B = max(T+1, 36), two or more at B + 10;",
        "kept bands last the tenant's median reuse gap. Variants at 1 / 2 / 5 / 10 % GPU-only (lru",
        "4.0 / 8.0 / 16.4 / 27.5 %): without durations 4.28 / 8.92 / 17.21 / 28.38 % (same on this trace,",
        "but a premium chat tenant next to a flood keeps 84 % of its solo rate instead of 90 %); one kept",
        "band for any prior use 4.22 / 8.34 / 17.06 / 28.57 %; a third band at ≥ 3 uses 4.44 / 8.77 /",
        "16.94 / 27.48 % (below lru at 10 %); probability bands instead of use counts (kept at p ≥ 5 %,",
        "upper band at p ≥ 12 % or 25 %, first uses by p too) 3.9–4.2 / 8.0–8.2 / 16.0–16.5 / 27.1–27.9 %.",
        "",
        "Tried before, with the earlier single kept band by p (8.1 % at 2 %), none kept: finer kept",
        "levels by p 7.97–8.35 %; other `horizon_quantile`s 8.04–8.16 %; a per-block estimate of",
        "P(used again within H | prior uses, last-gap bucket) in 4 bands 7.7–8.8 % (and below lru at",
        "10 %); H scaled to the pool's turnover 7.6 / 8.4 %. With a scratch replay of the same model",
        "(it reproduces lru's 8.02 % exactly): LFU 7.9 %; LRFU, half-lives 10–3,000 s, 7.7–8.2 %; uses",
        "in the past 30–1,000 s 7.1–7.9 %.",
        "",
        f"With a host tier `adaptive` {host_verdict} TensorRT-LLM defaults at every capacity. With a host the bands",
        "keep recency order in both tiers and sink only measured one-shot traffic to T (offload keeps a block's",
        "priority and clears its duration, so GPU bands above 35 would become permanent host priorities), and",
        "where they do not win the pool stays on the defaults.",
    ]
    return "\n".join(lines), [gpu_only, with_host]


def plot(reports, distinct: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu_only, with_host = reports
    xs = [100 * f for f in FRACTIONS]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.plot(xs, [100 * r.results["lru"].hit_rate for r in gpu_only], "o-", label="lru (GPU only)")
    ax.plot(xs, [100 * r.results["adaptive"].hit_rate for r in gpu_only], "s-", label="adaptive (GPU only)")
    ax.plot(xs, [100 * r.belady_gpu.hit_rate for r in gpu_only], "k--", label="Belady (GPU only)")
    ax.plot(xs, [100 * r.results["oracle-reuse"].hit_rate for r in gpu_only], "^--", color="0.55",
            label="oracle-reuse (GPU only, offline)")
    within = [f"oracle-reuse-within-{t:g}s" for t in HORIZONS_S]
    ax.plot(xs, [100 * max(r.results[n].hit_rate for n in within) for r in gpu_only], "v--", color="0.4",
            label="oracle-reuse-within, best T (GPU only, offline)")
    ax.plot(xs, [100 * r.results["oracle-next-use"].hit_rate for r in gpu_only], "d--", color="0.25",
            label="oracle-next-use (GPU only, offline)")
    popular = [f"oracle-popularity-{w:g}s" for w in WINDOWS_S if w >= 300]
    ax.plot(xs, [100 * max(r.results[n].hit_rate for n in popular) for r in gpu_only], "x--", color="0.7",
            label="oracle-popularity, best W >= 300 s (GPU only, offline)")
    ax.plot(xs, [100 * r.results["trtllm-default"].hit_rate for r in with_host], "o-", label="trtllm-default (+host 4x)")
    ax.plot(xs, [100 * r.results["adaptive"].hit_rate for r in with_host], "s-", label="adaptive (+host 4x)")
    ax.plot(xs, [100 * r.belady_total.hit_rate for r in with_host], "k:", label="Belady (GPU + host)")
    ax.set_xlabel("GPU capacity (% of the trace's distinct blocks)")
    ax.set_ylabel("prompt-token hit rate (%)")
    ax.set_title("Mooncake synthetic trace, --hold none")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def noisy_section(seed: int = 1, gpu_blocks: int = 128) -> str:
    spec = NoisyNeighbourSpec()
    mixed = parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=seed)])
    solo = parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=seed, include_noisy=False)])
    cfg = SimConfig()

    def run(trace, name, mapping=None):
        policy = make_policy(name, mapping=None if mapping is None else ClassMapping.from_dict(mapping))
        policy.uses_host = False  # one GPU tier: the contest is for GPU blocks
        result = simulate(trace, policy, primary_blocks=gpu_blocks, secondary_blocks=0, config=cfg)
        return result, getattr(policy, "demotions", 0)

    base = {"offload_min_priority": 35, "default": "standard"}
    classes = dict(base, classes={"premium": PREMIUM_CLASS, "standard": STANDARD_CLASS}, tenants={"premium": "premium"})
    standard = dict(base, classes={"standard": STANDARD_CLASS})
    alone, _ = run(solo, "lru")
    solo_rate = alone.tenants["premium"].hit_rate
    rows = [
        ("premium alone, lru", alone, 0, "—"),
    ]
    for label, name, mapping in [
        ("lru", "lru", None),
        ("adaptive", "adaptive", None),
        ("classes (premium 90/70/50, noisy 35)", "class", classes),
        ("quotas only (50 % each, all at 35)", "class", dict(standard, quotas={"premium": 0.5, "noisy": 0.5})),
        ("classes + quota on noisy (50 %)", "class", dict(classes, quotas={"noisy": 0.5})),
        ("classes + quotas (50 % each)", "class", dict(classes, quotas={"premium": 0.5, "noisy": 0.5})),
    ]:
        result, demotions = run(mixed, name, mapping)
        rows.append((label, result, demotions, pct(result.tenants["premium"].hit_rate / solo_rate)))
    premium_requests = sum(1 for r in mixed if r.tenant == "premium")
    lines = [
        "## Noisy neighbour (bench/retention/simulate.py, retention/workloads/noisy.py)",
        "",
        seed_line(seed, "`noisy_neighbour_trace(spec, seed=...)`: session starts, turns, think times, "
                        "the flood's prompts"),
        "",
        f"Premium: {spec.turns}-turn chat sessions over a shared {spec.system_blocks}-block system prompt at "
        f"{spec.premium_rps} req/s ({premium_requests} requests); noisy: unique {spec.noisy_blocks}-block prompts at "
        f"{spec.flood_factor:.0f}× that rate ({len(mixed) - premium_requests} requests); {spec.duration_s:.0f} s, "
        f"seed {seed}, one GPU tier of {gpu_blocks} blocks × 512 tokens, `--hold none`.",
        "",
        "| setup | premium hit rate | of premium alone | noisy hit rate | requests planned over quota |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, result, demotions, share in rows:
        noisy = result.tenants.get("noisy")
        lines.append(
            f"| {label} | {pct(result.tenants['premium'].hit_rate)} | {share} | "
            f"{'—' if noisy is None else pct(noisy.hit_rate)} | {demotions:,} |"
        )
    lines += [
        "",
        "Reading: under plain LRU the flood evicts the premium sessions between turns. Classes",
        "alone restore the solo hit rate, and so do classes with a quota on the flooding tenant.",
        "Quotas alone (50 % each, everyone at the default priority) keep the premium tenant at",
        "about 90 % of its solo rate: the flooder is over its share almost all the time, so its",
        "new blocks go first. Classes *plus* a 50 % quota on the premium tenant hurt it: quotas",
        "count cached blocks, the premium's high-priority cache soon exceeds half of the pool, and",
        "then its *new* blocks are demoted. Size a protected tenant's quota above its working set.",
        "`adaptive` needs no configuration: the flood's measured reuse is ~0, so its blocks sink",
        "below the premium's.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--write-trace", type=Path, help="also write the noisy-neighbour trace (JSONL) here")
    args = parser.parse_args()
    if args.write_trace:
        args.write_trace.write_text("".join(json.dumps(x) + "\n" for x in noisy_neighbour_trace(NoisyNeighbourSpec(), seed=1)))
    with TRACE.open() as handle:
        requests = parse_trace(handle)
    distinct = distinct_blocks(requests)
    mooncake, reports = mooncake_section(requests, distinct)
    noisy = noisy_section()
    print(mooncake, "\n", noisy, sep="\n")
    if not args.no_write:
        plot(reports, distinct)
        write_section("simulator", mooncake)
        write_section("noisy_neighbour", noisy)
        print("wrote docs/benchmarks.md sections bench:simulator, bench:noisy_neighbour and", PLOT)


if __name__ == "__main__":
    main()
