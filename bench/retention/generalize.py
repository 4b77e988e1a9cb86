"""Retention that generalizes: every workload family × GPU 1/2/5/10 % × host 0 / 4×.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/generalize.py [--no-write] [--workers N] [--only a,b]``

Writes the ``bench:generalize`` section of docs/benchmarks.md and docs/img/generalize.png.
Deterministic (seed 0 for every generated family; the public synthetic trace as is).

Policies: ``lru`` (35 everywhere, GPU only), ``trtllm-default`` (35 everywhere, host tier,
threshold 30; with no host tier it *is* lru), ``adaptive`` (with selection:
retention/policy/selection.py; candidates static, bands and, GPU only, protect), ``adaptive-bands`` (the bands alone, for reference) and Belady
(GPU only, and GPU + host blocks as one tier: a ceiling, not a policy). Families and their
roles (tune / report only) are in retention/workloads/__init__.py.

Target checks, printed and written: in every setting adaptive ≥ 0.98 × the
best of lru / trtllm-default; on the chat families adaptive ≥ 1.3 × lru at 2 % GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, synthetic_trace, workload_grid, write_section  # noqa: E402

TRACE = synthetic_trace()
PLOT = ROOT / "docs" / "img" / "generalize.png"
SEED = 0  # every generated family is drawn with it
FRACTIONS = (0.01, 0.02, 0.05, 0.10)
HOSTS = (0, 4)
CHAT = ("chat", "chat-long", "rag-chat", "synthetic")  # conversation families: the 2 % GPU-only check is 1.3 × lru
POLICIES = ("lru", "trtllm-default", "adaptive", "adaptive-bands")


def workloads() -> dict[str, str]:
    from retention.workloads import families

    out = {"synthetic": "tune"}
    out.update({f.name: f.role for f in families()})
    return out


def load(name: str):  # noqa: ANN201
    from retention.trace import parse_trace
    from retention.workloads import families

    if name == "synthetic":
        with TRACE.open() as handle:
            return parse_trace(handle)
    family = next(f for f in families() if f.name == name)
    return parse_trace([json.dumps(x) for x in family.generate(SEED)])


def run_workload(name: str) -> dict:
    """Every policy at every capacity and host setting for one workload (one process)."""
    from retention.simulation.belady import belady, chain_request
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import SimConfig, request_hashes, simulate
    from retention.trace import distinct_blocks

    started = time.perf_counter()
    requests = load(name)
    config = SimConfig()
    hashes = request_hashes(requests, config)
    chains = [chain_request(h, r.input_length, 512) for h, r in zip(hashes, requests, strict=True)]
    distinct = distinct_blocks(requests)
    rows = []
    for fraction in FRACTIONS:
        gpu = max(1, round(distinct * fraction))
        lru = simulate(requests, make_policy("lru"), primary_blocks=gpu, secondary_blocks=0, hashes=hashes)
        for host_factor in HOSTS:
            host = host_factor * gpu
            cells = {"lru": lru.hit_rate}
            extra = {}
            for policy_name in POLICIES[1:]:
                if policy_name == "trtllm-default" and not host:
                    cells[policy_name] = lru.hit_rate  # identical plans, no host tier: the same replay
                    continue
                policy = make_policy(policy_name)
                result = simulate(requests, policy, primary_blocks=gpu, secondary_blocks=host, hashes=hashes)
                cells[policy_name] = result.hit_rate
                if policy_name == "adaptive":
                    duel = policy.selector.duel if policy.selector is not None else None
                    extra = {
                        "final": duel.chosen() if duel else "static",
                        "switches": duel.switches() if duel else 0,
                        "rate": duel.sample.rate if duel else 0.0,
                        "host_hit": result.host_hit_rate,
                    }
            cells["belady"] = belady(chains, gpu + host, 512).hit_rate
            rows.append({"fraction": fraction, "host": host_factor, "gpu_blocks": gpu, **cells, **extra})
    return {"name": name, "requests": len(requests), "distinct": distinct, "rows": rows,
            "seconds": time.perf_counter() - started}


def system_share(name: str) -> float | None:
    """Share of prompt tokens in shared system prompts (generated families that mark them), else None."""
    if name == "synthetic":
        return None
    requests = load(name)
    if any(r.system_tokens is None for r in requests):
        return None
    return sum(r.system_tokens for r in requests) / sum(r.input_length for r in requests)


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def check(result: dict) -> list[str]:
    """Shortfalls against the targets, one line each."""
    out = []
    for row in result["rows"]:
        best = max(row["lru"], row["trtllm-default"])
        where = f"{result['name']} GPU {row['fraction']:.0%} host {row['host']}×"
        if best and row["adaptive"] < 0.98 * best:
            out.append(f"{where}: adaptive {pct(row['adaptive'])} % < 0.98 × best baseline {pct(best)} % "
                       f"({row['adaptive'] / best:.3f}×)")
        if result["name"] in CHAT and row["fraction"] == 0.02 and row["host"] == 0 and row["lru"]:
            ratio = row["adaptive"] / row["lru"]
            if ratio < 1.3:
                out.append(f"{where}: adaptive {pct(row['adaptive'])} % = {ratio:.2f}× lru ({pct(row['lru'])} %), "
                           "short of 1.3×")
    return out


def section(results: list[dict], roles: dict[str, str], seconds: float) -> str:
    lines = [
        "## Retention that generalizes (bench/retention/generalize.py)",
        "",
        seed_line(SEED, "every generated family of retention/workloads/ drawn with this seed; "
                        "the public synthetic trace is read as it is"),
        "",
        f"Every workload family (retention/workloads/, seed {SEED}) and the public synthetic trace, `--hold none`,",
        "512-token blocks, GPU capacity as a share of the workload's distinct blocks, host tier 0 or 4× the GPU.",
        "Hit rate = prompt tokens served from cache (GPU + host) / prompt tokens, in %. `lru` has no host tier by",
        "definition (same value in both settings); `trtllm-default` without a host tier is `lru`. `adaptive` is",
        "adaptive with selection (retention/policy/selection.py: the static class — here TensorRT-LLM defaults —,",
        "adaptive's host-aware bands or, GPU only, `protect` (retention/policy/protect.py: a live subset of conversations",
        "that fits the GPU kept above the rest), whichever wins on 5 % shadows, raised to ≥ 64 shadow blocks), `bands` the",
        "bands alone. `ratio` = adaptive / best of lru and trtllm-default; `final` = the candidate the pool",
        "follows at the end (switches). Belady: GPU (+ host) blocks as one tier, a ceiling. Roles: **tune** =",
        "families policies were tuned on; *report* = held out, never used to pick a parameter.",
        f"{len(results)} workloads, {seconds:.0f} s of replays summed over the workloads ({machine()}, shared).",
        "",
        "| workload | host | GPU | lru | trtllm-default | adaptive | ratio | bands | final (switches) | Belady |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    shortfalls: list[str] = []
    for result in results:
        role = roles[result["name"]]
        label = f"**{result['name']}** (tune)" if role == "tune" else f"*{result['name']}* (report)"
        for row in sorted(result["rows"], key=lambda r: (r["host"], r["fraction"])):
            best = max(row["lru"], row["trtllm-default"])
            ratio = row["adaptive"] / best if best else 1.0
            mark = "" if ratio >= 0.98 else " ✗"
            lines.append(
                f"| {label} | {row['host']}× | {row['fraction']:.0%} | {pct(row['lru'])} | {pct(row['trtllm-default'])} | "
                f"{pct(row['adaptive'])} | {ratio:.3f}{mark} | {pct(row['adaptive-bands'])} | "
                f"{row.get('final', '-')} ({row.get('switches', 0)}) | {pct(row['belady'])} |"
            )
        shortfalls += check(result)
    chat_lines = []
    for result in results:
        if result["name"] in CHAT:
            row = next(r for r in result["rows"] if r["fraction"] == 0.02 and r["host"] == 0)
            chat_lines.append(f"{result['name']} {row['adaptive'] / row['lru']:.2f}×")
    worst = min(
        (row["adaptive"] / max(row["lru"], row["trtllm-default"]), result["name"], row["fraction"], row["host"])
        for result in results for row in result["rows"] if max(row["lru"], row["trtllm-default"])
    )
    lines += [
        "",
        f"![hit rate per workload]({PLOT.relative_to(ROOT / 'docs').as_posix()})",
        "",
        f"Checks. Worst ratio {worst[0]:.3f} ({worst[1]}, GPU {worst[2]:.0%}, host {worst[3]}×). Chat-like families at 2 %",
        f"GPU only, adaptive / lru: {', '.join(chat_lines)}.",
        "",
    ]
    if shortfalls:
        lines += ["Shortfalls against the targets:", ""] + [f"* {s}" for s in shortfalls]
    else:
        lines.append("No shortfall: every setting meets 0.98 × the best baseline and every chat family 1.3 × lru at 2 %.")
    settings = [(result["name"], row) for result in results for row in result["rows"]]
    bands_low = sorted(
        (row["adaptive-bands"] / max(row["lru"], row["trtllm-default"]), name, row["fraction"], row["host"])
        for name, row in settings if max(row["lru"], row["trtllm-default"])
    )
    bands_below = [b for b in bands_low if b[0] < 0.98]
    host_rows = [row for _, row in settings if row["host"]]
    host_deficit = max(row["trtllm-default"] - row["adaptive-bands"] for row in host_rows)
    host_gain = max(row["adaptive-bands"] - row["trtllm-default"] for row in host_rows)
    gains = [(row["adaptive"] / row["lru"], name, row["fraction"]) for name, row in settings
             if not row["host"] and row["lru"] and row["adaptive"] > row["lru"]]
    protect_rows = [(name, row) for name, row in settings if row.get("final") == "protect"]
    history = []
    for result in results:
        share = system_share(result["name"]) if result["name"] in CHAT else None
        if share is None:
            continue
        row = next(r for r in result["rows"] if r["fraction"] == 0.02 and r["host"] == 0)
        history.append(
            f"{result['name']}: system prompts are {pct(share)} % of prompt tokens and LRU hits them, so of lru's "
            f"{pct(row['lru'])} % only {pct(row['lru'] - share)} points are history (Belady {pct(row['belady'] - share)}, "
            f"adaptive {pct(row['adaptive'] - share)}); 1.3× needs {pct(1.3 * row['lru'] - share)}")
    lines += [
        "",
        f"Reading. The bands alone fall below 0.98 × the best baseline in {len(bands_below)} of {len(settings)} settings"
        + (" (" + "; ".join(f"{n} GPU {f:.0%} host {h}×: {r:.3f}" for r, n, f, h in bands_below[:6]) + ")" if bands_below else "")
        + "; with selection the pool stays on (or returns to) the static plan there. With a host tier the",
        f"host-aware bands (recency order, only measured one-shot blocks sunk to T) are at most {100 * host_deficit:.1f} points",
        f"below TensorRT-LLM's defaults and up to {100 * host_gain:.1f} above; the old GPU bands lost up to 15 points there",
        "(chat, 2 %: 60.4 % vs 75.4 %), because",
        "offloaded blocks keep their kept-band priority forever in the host. Where a candidate wins (GPU only, small",
        "capacities) selection follows it, up to " + (
            f"{max(gains)[0]:.2f}× lru ({max(gains)[1]}, GPU {max(gains)[2]:.0%})" if gains else "—")
        + "; it costs a little against the winning candidate alone (the contest runs on a",
        "sample and starts on the static plan). The pool follows `protect` in "
        + (", ".join(f"{n} GPU {row['fraction']:.0%}" for n, row in protect_rows) or "no setting") + ".",
        "",
        "Why the chat families stay short of 1.3 × lru at 2 % GPU only. " + "; ".join(history) + ".",
        "So 1.3× needs 2–3× LRU's history hits. The generators draw every think time",
        "independently (lognormal) and never reveal how many turns a session will have, so nothing the gateway",
        "knows says which history comes back soon; Belady knows. The hit-density ceiling of every policy that",
        "ranks idle blocks by age and class (`bench:age_ceiling`, the next section, with its figures) is below",
        "1.3× lru on the generated chat families at 2 % GPU only: out of reach for any online policy of that",
        "kind, selection included.",
        "The held-out real trace (old adaptive 1.74× lru at 2 %) is where the criterion is checked.",
    ]
    return "\n".join(lines)


def plot(results: list[dict], roles: dict[str, str]) -> None:
    xs = [100 * f for f in FRACTIONS]

    def draw(ax, result: dict) -> None:  # noqa: ANN001 - a matplotlib Axes
        def series(key: str, host: int) -> list[float]:
            by = {r["fraction"]: r for r in result["rows"] if r["host"] == host}
            return [100 * by[f][key] for f in FRACTIONS]

        ax.plot(xs, series("lru", 0), "o-", color="C0", label="lru (GPU)")
        ax.plot(xs, series("adaptive", 0), "s-", color="C1", label="adaptive (GPU)")
        ax.plot(xs, series("belady", 0), "k--", lw=0.8, label="Belady (GPU)")
        ax.plot(xs, series("trtllm-default", 4), "o-", color="C2", label="trtllm-default (+host 4×)")
        ax.plot(xs, series("adaptive", 4), "s-", color="C3", label="adaptive (+host 4×)")
        ax.plot(xs, series("belady", 4), "k:", lw=0.8, label="Belady (GPU+host)")

    workload_grid(results, roles, draw, PLOT, xlabel="GPU capacity (% of distinct blocks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2, help="processes (one workload each)")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--json", type=Path, help="also dump the raw results here")
    parser.add_argument("--merge", help="comma-separated --json dumps of earlier runs: write their union, run nothing")
    args = parser.parse_args()
    roles = workloads()
    names = [n for n in roles if not args.only or n in args.only.split(",")]
    started = time.perf_counter()
    if args.merge:
        loaded = {r["name"]: r for path in args.merge.split(",") for r in json.loads(Path(path).read_text())}
        results = [loaded[name] for name in names if name in loaded]
        finish(results, roles, sum(r["seconds"] for r in results), args)
        return
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        by_name = {}
        futures = [pool.submit(run_workload, name) for name in names]
        for future in as_completed(futures):
            result = future.result()
            print(f"{result['name']}: {result['seconds']:.0f} s", file=sys.stderr, flush=True)
            for row in result["rows"]:
                print(result["name"], json.dumps(row), file=sys.stderr, flush=True)
            by_name[result["name"]] = result
        results = [by_name[name] for name in names]
    finish(results, roles, sum(r["seconds"] for r in results), args)


def finish(results: list[dict], roles: dict[str, str], seconds: float, args: argparse.Namespace) -> None:
    text = section(results, roles, seconds)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.no_write:
        plot(results, roles)
        write_section("generalize", text)
        print("wrote docs/benchmarks.md section bench:generalize and", PLOT)


if __name__ == "__main__":
    main()
