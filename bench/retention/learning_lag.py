"""Selection's learning lag: ``adaptive`` against the best single policy in hindsight as traces grow.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/learning_lag.py [--no-write] [--workers 2] [--scales 1,2,4]
[--only chat,agent-mixed] [--save raw.json] [--from-json raw.json]``

Writes the ``bench:learning_lag`` section of docs/benchmarks.md. Deterministic: every trace is drawn
with seed 0 (``bench/retention/conversation.py``'s), at its family's duration × 1, 2 and 4.

* Cells: those of ``bench/retention/conversation.py``'s verdict where ``adaptive`` trails the best single
  candidate by more than 0.25 points (chat 2 % and 1 % GPU, chat-long 2 %, noisy-neighbour 2 %, host
  0; agent-mixed 2 % with host 4×), and one control where it does not (agent-loop 2 %, host 0).
* Traces: the family's own spec (``retention/workloads/__init__.py``) with every ``duration_s``
  multiplied (agent-mixed: both its agent and its api spec); arrival rates, session shapes and the
  seed unchanged, so a longer trace is more of the same traffic. The × 1 trace is checked equal to
  the family's ``generate(0)``.
* Capacity, two sizings: "share" = GPU blocks = round(fraction × the trace's own distinct blocks),
  as ``bench/retention/conversation.py`` sizes it (a longer trace has more distinct blocks, so a bigger pool:
  another workload in effect), and "fixed" = the × 1 trace's pool at every length (the same traffic
  against the same pool for longer: the amortization question). Host blocks = host multiple × GPU.
  The slow families (agent-mixed, agent-loop) are not run at × 4 under "share" (run time).
* Policies: ``adaptive``, and ``adaptive+end`` in families whose requests offer tools (elsewhere it
  plans exactly as ``adaptive``: no run ends in a message); the single policies ``lru``,
  ``adaptive-bands`` and ``protect`` (``bench/retention/conversation.py``'s "best age-based" set, without
  ``adaptive`` itself). Gap = adaptive − the best single, in hit-rate points, over the whole trace
  and over its second half (in trace time) only, each with the best single of that window.
* Second half: the simulator reports cumulative counts only, so every policy is replayed twice, on
  the whole trace and on the requests before the midpoint (with the deletions up to the last of
  them); a replay is deterministic and one request at a time, so the prefix run's counts are the
  whole run's counts at the midpoint, and the second half's hit rate is the difference of the two
  (hit tokens over prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, write_section  # noqa: E402

SEED = 0
SCALES = (1, 2, 4)
SINGLES = ("lru", "adaptive-bands", "protect")
ADAPTIVE = ("adaptive", "adaptive+end")


@dataclass(frozen=True, slots=True)
class Cell:
    family: str
    fraction: float  # GPU share of the × 1 trace's distinct blocks
    host: int  # host blocks per GPU block
    control: bool = False

    @property
    def label(self) -> str:
        return f"{self.family} {100 * self.fraction:g} %" + (f", host {self.host}×" if self.host else "")


CELLS = (
    Cell("chat", 0.02, 0), Cell("chat", 0.01, 0), Cell("chat-long", 0.02, 0), Cell("noisy-neighbour", 0.02, 0),
    Cell("agent-mixed", 0.02, 4), Cell("agent-loop", 0.02, 0, control=True),
)


def trace_lines(family: str, scale: int, seed: int = SEED) -> tuple[list[dict], float]:
    """The family's trace lines with every duration × ``scale``, and that duration (seconds)."""
    from retention.workloads import AGENT_LOOP, CHAT, CHAT_LONG
    from retention.workloads.agent import agent_trace
    from retention.workloads.chat import chat_trace
    from retention.workloads.mixed import MixedSpec, mixed_trace
    from retention.workloads.noisy import NoisyNeighbourSpec, noisy_neighbour_trace

    if family in ("chat", "chat-long"):
        spec = CHAT if family == "chat" else CHAT_LONG
        spec = replace(spec, duration_s=spec.duration_s * scale)
        return chat_trace(spec, seed=seed), spec.duration_s
    if family == "agent-loop":
        spec = replace(AGENT_LOOP, duration_s=AGENT_LOOP.duration_s * scale)
        return agent_trace(spec, seed=seed), spec.duration_s
    if family == "noisy-neighbour":
        spec = NoisyNeighbourSpec()
        spec = replace(spec, duration_s=spec.duration_s * scale)
        return noisy_neighbour_trace(spec, seed=seed), spec.duration_s
    if family == "agent-mixed":
        base = MixedSpec()
        if base.agent.duration_s != base.api.duration_s:
            raise ValueError("agent-mixed's two tenants are expected over one duration")
        spec = MixedSpec(agent=replace(base.agent, duration_s=base.agent.duration_s * scale),
                         api=replace(base.api, duration_s=base.api.duration_s * scale))
        return mixed_trace(spec, seed=seed), spec.agent.duration_s
    raise KeyError(family)


def load(family: str, scale: int):  # noqa: ANN201 - (requests, deletions, duration_s)
    from retention.trace import parse_trace_events
    from retention.workloads import families

    lines, duration = trace_lines(family, scale)
    if scale == 1:  # the scaled spec is the family's own: its × 1 trace is the one the other benches replay
        own = next(f for f in families() if f.name == family).generate(SEED)
        if own != lines:
            raise AssertionError(f"{family}: the × 1 trace differs from the family's generate({SEED})")
    requests, deletions = parse_trace_events([json.dumps(x) for x in lines])
    return requests, deletions, duration


def prefix(requests: list, deletions: list, at_ms: float) -> tuple[list, list]:
    """The requests before ``at_ms`` and the deletions up to the last of them (those a replay of the whole
    trace has delivered by then)."""
    head = [r for r in requests if r.timestamp_ms < at_ms]
    last = head[-1].timestamp_ms if head else float("-inf")
    return head, [d for d in deletions if d.timestamp_ms <= last]


def window_rate(whole: tuple[int, int], head: tuple[int, int]) -> float:
    """Hit rate of the requests after the head, from cumulative (hit tokens, prompt tokens) counts."""
    prompt = whole[1] - head[1]
    return (whole[0] - head[0]) / prompt if prompt else 0.0


def halves(requests: list, deletions: list, at_ms: float, factory, gpu: int, host: int):  # noqa: ANN001, ANN201
    """(whole-trace hit rate, hit rate after ``at_ms``, the whole run's policy) for one policy."""
    from retention.simulation.simulator import simulate

    policy = factory()
    whole = simulate(requests, policy, primary_blocks=gpu, secondary_blocks=host, deletions=deletions)
    head_requests, head_deletions = prefix(requests, deletions, at_ms)
    head = simulate(head_requests, factory(), primary_blocks=gpu, secondary_blocks=host, deletions=head_deletions)
    return (whole.hit_rate, window_rate((whole.hit_tokens, whole.prompt_tokens), (head.hit_tokens, head.prompt_tokens)),
            policy)


def run_task(cell: Cell, scale: int, sizing: str) -> dict:
    """Every policy on one cell's trace at ``scale``, its GPU sized by ``sizing`` ("share" or "fixed")."""
    from retention.simulation.sim_policies import make_policy
    from retention.trace import distinct_blocks

    started = time.perf_counter()
    requests, deletions, duration = load(cell.family, scale)
    distinct = distinct_blocks(requests)
    basis = distinct if sizing == "share" else distinct_blocks(load(cell.family, 1)[0])
    gpu = max(1, round(cell.fraction * basis))
    host = gpu * cell.host
    tools = any(r.offers_tools for r in requests)
    names = (*SINGLES, *(ADAPTIVE if tools else ADAPTIVE[:1]))
    out: dict = {"cell": cell.label, "scale": scale, "sizing": sizing, "requests": len(requests),
                 "distinct": distinct, "gpu": gpu, "host": host, "whole": {}, "second": {}, "switches": {}}
    for name in names:
        whole, second, policy = halves(requests, deletions, duration * 500.0, lambda n=name: make_policy(n), gpu, host)
        out["whole"][name], out["second"][name] = whole, second
        selector = getattr(getattr(policy, "inner", policy), "selector", None)
        if selector is not None:
            duel = selector.duel
            out["switches"][name] = (duel.switches(), duel.names[duel.pool_scope.current])
    out["seconds"] = time.perf_counter() - started
    return out


def gaps(values: dict[str, float]) -> dict[str, tuple[float, str]]:
    """Per adaptive variant: (variant − best single, in points; the best single's name)."""
    best = max(SINGLES, key=lambda n: values[n])
    return {n: (100 * (values[n] - values[best]), best) for n in ADAPTIVE if n in values}


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def table(results: list[dict]) -> list[str]:
    lines = ["| cell | trace | GPU (host) blocks | adaptive | best single | gap | 2nd half: adaptive | best single | gap "
             "| adaptive+end gap (whole / 2nd half) | adaptive's switches, final |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---:|---|"]
    for r in results:
        w, s = gaps(r["whole"]), gaps(r["second"])
        bw, bs = w["adaptive"][1], s["adaptive"][1]
        end = (f"{w['adaptive+end'][0]:+.2f} / {s['adaptive+end'][0]:+.2f}" if "adaptive+end" in w else "= adaptive")
        sizing = "" if r["scale"] == 1 else f", {r['sizing']}"
        switches, final = r["switches"].get("adaptive", (0, "?"))
        lines.append(
            f"| {r['cell']} | ×{r['scale']}{sizing} ({r['requests']:,} req.) | {r['gpu']:,} ({r['host']:,}) | "
            f"{pct(r['whole']['adaptive'])} | {bw} {pct(r['whole'][bw])} | {w['adaptive'][0]:+.2f} | "
            f"{pct(r['second']['adaptive'])} | {bs} {pct(r['second'][bs])} | {s['adaptive'][0]:+.2f} | {end} | "
            f"{switches}, {final} |")
    return lines


SLOW = ("agent-mixed", "agent-loop")  # × 4 under the "share" sizing left out for these (run time)


TIE = 0.1  # points: a second-half gap this small counts as closed


def series(results: list[dict], sizing: str) -> dict[str, list[dict]]:
    """Per cell, its rows under ``sizing`` (the × 1 row belongs to both), by scale."""
    out: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["scale"]):
        if r["scale"] == 1 or r["sizing"] == sizing:
            out.setdefault(r["cell"], []).append(r)
    return out


def trend(rows: list[dict], name: str = "adaptive") -> str:
    """"a / b / c (2nd half d / e / f)": the gap per scale, whole trace then second half."""
    whole = " / ".join(f"{gaps(r['whole'])[name][0]:+.2f}" for r in rows)
    second = " / ".join(f"{gaps(r['second'])[name][0]:+.2f}" for r in rows)
    return f"{whole} (2nd half {second})"


def verdict(rows: list[dict]) -> str:
    """From the second-half gaps of the longer traces: closed (all within TIE), kept (all below), or mixed."""
    later = [gaps(r["second"])["adaptive"][0] for r in rows if r["scale"] > 1]
    if not later:
        return "not measured longer"
    if all(g >= -TIE for g in later):
        return "closed"
    return "kept" if all(g < -TIE for g in later) else "mixed"


def reading(results: list[dict]) -> list[str]:
    """What the table shows, computed from it: the fixed pool answers the amortization question."""
    fixed, share = series(results, "fixed"), series(results, "share")
    scales = " / ".join(f"×{r['scale']}" for r in max(fixed.values(), key=len))
    classes: dict[str, list[str]] = {}
    for cell, rows in fixed.items():
        classes.setdefault(verdict(rows), []).append(cell)
    names = {"closed": f"closes (every longer trace's 2nd-half gap within {TIE:g} points)",
             "kept": f"stays (every longer trace's 2nd-half gap below -{TIE:g} points: a steady-state loss)",
             "mixed": "closes at one longer length and opens at another"}

    def switches(cell: str) -> str:
        rows = fixed[cell]
        worst = min(rows, key=lambda r: gaps(r["second"])["adaptive"][0])
        below = all(worst["second"]["adaptive"] < worst["second"][n] for n in SINGLES)
        return (f"{cell} (switches " + " / ".join(str(r["switches"].get("adaptive", (0,))[0]) for r in rows)
                + (f"; at ×{worst['scale']} below every single policy over the 2nd half" if below else "") + ")")

    lines = [
        f"Reading. At the × 1 pool (\"fixed\": the same traffic against the same pool for longer), adaptive − best "
        f"single in points, {scales}: " + "; ".join(f"{cell} {trend(rows)}" for cell, rows in fixed.items()) + ".",
        "",
        "The gap " + "; ".join(f"{names[k]}: {', '.join(switches(c) for c in v)}" for k, v in sorted(classes.items()))
        + ". Up to 4 × the family's duration, a longer run amortizes the gap only where it closes; where it stays, "
        "it is a steady-state loss, not a one-time cost.",
    ]
    ends = {cell: rows for cell, rows in fixed.items() if "adaptive+end" in rows[0]["whole"]}
    if ends:
        lines += ["", "adaptive+end − best single, same pool: " + "; ".join(
            f"{cell} {trend(rows, 'adaptive+end')}" for cell, rows in ends.items()) + "."]
    longest = {cell: rows[-1] for cell, rows in share.items() if rows[-1]["scale"] > 1}
    if longest:
        grown = next(iter(longest))
        first = share[grown][0]
        lines += ["", "Under the \"share\" sizing a longer trace gets a bigger pool, i.e. another workload "
                  f"({grown}: lru {pct(first['whole']['lru'])} at × 1, {pct(longest[grown]['whole']['lru'])} at "
                  f"×{longest[grown]['scale']}); there the gaps at the longest length are "
                  + ", ".join(f"{cell} ×{r['scale']} {gaps(r['whole'])['adaptive'][0]:+.2f} (2nd half "
                              f"{gaps(r['second'])['adaptive'][0]:+.2f})" for cell, r in longest.items())
                  + ": the candidates' own gaps change with the pool, so these do not isolate the learning cost."]
    return lines


def tasks(cells: tuple[Cell, ...], scales: tuple[int, ...]) -> list[tuple[Cell, int, str]]:
    """(cell, scale, sizing): × 1 once (both sizings are the same pool), longer traces under both, but
    the slow families' × 4 only at the fixed pool (the amortization question; run time)."""
    out = [(c, k, z) for c in cells for k in scales for z in (("share",) if k == 1 else ("share", "fixed"))
           if not (k >= 4 and z == "share" and c.family in SLOW)]
    weight = {"agent-mixed": 3.0, "agent-loop": 2.0}  # replay cost per × 1 trace, roughly (longest first)
    return sorted(out, key=lambda t: -t[1] * weight.get(t[0].family, 1.0))


def run(workers: int, scales: tuple[int, ...], cells: tuple[Cell, ...]) -> tuple[str, list[dict]]:
    started = time.perf_counter()
    todo = tasks(cells, scales)
    done_by: dict[tuple[str, int, str], dict] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_task, *t): t for t in todo}
        for count, future in enumerate(as_completed(futures), start=1):
            cell, scale, sizing = futures[future]
            done_by[(cell.label, scale, sizing)] = future.result()
            print(f"[{time.perf_counter() - started:5.0f} s] {count}/{len(futures)} {cell.label} ×{scale} {sizing}",
                  file=sys.stderr, flush=True)
    order = {z: i for i, z in enumerate(("share", "fixed"))}
    results = [done_by[k] for k in sorted(done_by, key=lambda k: ([c.label for c in cells].index(k[0]), order[k[2]],
                                                                    k[1]))]
    return render(results, time.perf_counter() - started, workers), results


def render(results: list[dict], seconds: float, workers: int) -> str:
    lines = [
        "## Selection's learning lag: adaptive against the best single policy as traces grow (bench/retention/learning_lag.py)",
        "",
        seed_line(SEED, "every family's generator at its own spec with each duration × 1, 2, 4: sessions, runs, think "
                  "and tool times, deletions; the × 1 traces are `bench/retention/conversation.py`'s"),
        "",
        "`bench/retention/learning_lag.py`: the cells where `adaptive` trails the best single candidate in "
        "`bench/retention/conversation.py`'s verdict, and agent-loop 2 % (where it does not) as a control, on traces of the "
        "same family 1, 2 and 4 times as long (same rates, same seed). Best single = the best of lru, "
        "adaptive-bands and protect in hindsight, per window; gap = adaptive − that, in points; \"2nd half\" = "
        "the requests after the trace's midpoint in time (each policy replayed on the whole trace and on the "
        "first half, counts differenced). Sizing: \"share\" = GPU blocks = the GPU share × the trace's own "
        "distinct blocks, as `bench/retention/conversation.py` sizes it (a longer trace gets a bigger pool); \"fixed\" = "
        "the × 1 trace's pool at every length. Host = the host multiple × GPU. `adaptive+end` is replayed where "
        "requests offer tools; elsewhere it plans exactly as `adaptive`. Last column: the pool's switches in "
        "`adaptive`'s duel over the whole trace and the candidate it ends on.",
        "",
        *table(results),
        "",
        *reading(results),
        "",
        f"{len(results)} traces, {seconds:.0f} s with {workers} workers ({machine()}, shared); × 4 under the "
        f"\"share\" sizing not run for {' and '.join(SLOW)} (run time).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scales", default=",".join(map(str, SCALES)), help="duration multiples, comma-separated")
    parser.add_argument("--only", default=None, help="families, comma-separated")
    parser.add_argument("--save", type=Path, default=None, help="write the raw results (JSON) here")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="render saved raw results (and their run time) instead of replaying")
    args = parser.parse_args()
    cells = tuple(c for c in CELLS if args.only is None or c.family in args.only.split(","))
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        results = saved["results"]
        section = render(results, saved["seconds"], saved["workers"])
    else:
        started = time.perf_counter()
        section, results = run(args.workers, tuple(int(x) for x in args.scales.split(",")), cells)
        if args.save is not None:
            args.save.write_text(json.dumps({"results": results, "seconds": time.perf_counter() - started,
                                             "workers": args.workers}))
    print(section)
    if not args.no_write:
        write_section("learning_lag", section)


if __name__ == "__main__":
    main()
