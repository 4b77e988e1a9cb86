"""Conversation-aware retention measured: every workload family, next to LRU, the age-based policies and Belady.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/conversation.py [--no-write] [--workers 2] [--fractions 0.02]
[--hosts 0] [--only a,b]``

Writes the ``bench:conversation`` section of docs/benchmarks.md. Deterministic: every generated
family is drawn with seed 0 (``bench/generalize.py``'s), the public synthetic trace is read as is.

* Families (``retention/workloads/__init__.py``, roles tune / report): ``agent-loop`` (agent
  runs as Responses chains, tools offered at every step, half the runs deleted when they end),
  ``chat`` (stored Responses conversations, half deleted after their last turn) and every
  other family (no conversation fields: there ``X+conv`` plans exactly as ``X``).
* Capacity: GPU 2 % of the trace's distinct 512-token blocks (``--fractions``), host 0
  (``--hosts``; with a host tier ``trtllm-default`` and ``trtllm-default+conv`` are added).
* Policies (``kvgate simulate`` names): ``lru``; ``trtllm-default`` (at host 0 it *is* lru:
  every block at 35, nowhere to offload, so its row is lru's); the age-based policies
  ``adaptive-bands``, ``protect`` and ``adaptive`` (selection among them, the gateway's
  default), whose best per setting is "best age-based"; conversation-aware ``lru+conv`` and
  ``adaptive+conv`` (``retention/simulation/conversational.py``: requests offering tools or
  storing their response held at priority 60 for the tenant's measured median gap, within a
  class allowing 1 h and half of the pool); ``lru+conv+demote`` and ``adaptive+conv+demote``
  (the same, and every delete replayed through the pool as the gateway's demote request:
  ``retention/policy/demote.py``; its requests and computed tokens are counted apart, never in
  the hit rate); Belady (GPU) as the ceiling.
* Columns: hit rate (prompt tokens served from cache), ×LRU, % of Belady.

The hold's knob (quantile × margin of the measured gaps) was chosen on ``chat`` (tune) only;
the grid is run again here (``--grid``) and printed with the section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, synthetic_trace, write_section  # noqa: E402
from retention.policy.conversation import GAP_MARGIN, GAP_QUANTILE  # noqa: E402

SEED = 0
FRACTIONS = (0.02,)
HOSTS = (0,)
AGE_BASED = ("lru", "adaptive-bands", "protect", "adaptive")
CONV = ("lru+conv", "adaptive+conv")
DEMOTE = ("lru+conv+demote", "adaptive+conv+demote")  # the same, each delete replayed as a demote request
TARGET_FAMILY, TARGET_RATIO = "agent-loop", 1.3
GRID = ((0.9, 2.0), (0.5, 1.0), (0.5, 0.5), (0.25, 1.0))  # (quantile, margin) tried on chat
CHOSEN = (GAP_QUANTILE, GAP_MARGIN)  # the rule the policy runs


def roles() -> dict[str, str]:
    from retention.workloads import families

    out = {f.name: f.role for f in families()}
    if synthetic_trace().exists():
        out["synthetic"] = "tune"
    return out


def load(name: str, limit: int | None = None):  # noqa: ANN201 - (requests, deletions)
    """The family's requests (the first ``limit``) and its deletions up to the last of them."""
    from retention.trace import parse_trace_events
    from retention.workloads import families

    if name == "synthetic":
        with synthetic_trace().open() as handle:
            requests, deletions = parse_trace_events(handle)
    else:
        family = next(f for f in families() if f.name == name)
        requests, deletions = parse_trace_events([json.dumps(x) for x in family.generate(SEED)])
    if limit is not None and limit < len(requests):
        requests = requests[:limit]
        deletions = [d for d in deletions if d.timestamp_ms <= requests[-1].timestamp_ms]
    return requests, deletions


def run_family(name: str, fractions: tuple[float, ...], hosts: tuple[int, ...], limit: int | None = None) -> dict:
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import run_simulation
    from retention.trace import distinct_blocks

    requests, deletions = load(name, limit)
    distinct = distinct_blocks(requests)
    out: dict = {"name": name, "requests": len(requests), "deletions": len(deletions),
                 "responses": sum(r.response_id is not None for r in requests),
                 "tools": sum(r.offers_tools for r in requests), "settings": []}
    started = time.perf_counter()
    for host in hosts:
        names = list(AGE_BASED) + list(CONV) + list(DEMOTE) + (["trtllm-default", "trtllm-default+conv"] if host else [])
        factories = [lambda n=n: make_policy(n) for n in names]
        if out["responses"] or out["tools"]:
            factories.append(_whole_quota)
        made: list = []  # every policy instance, in creation order (names per capacity)
        gpus = [max(1, round(f * distinct)) for f in fractions]
        reports = run_simulation(requests, [lambda f=f: made.append(f()) or made[-1] for f in factories], gpus,
                                 host_blocks=lambda g, h=host: g * h, deletions=deletions)
        for index, (fraction, report) in enumerate(zip(fractions, reports)):
            policies = made[index * len(factories):(index + 1) * len(factories)]
            out["settings"].append({
                "fraction": fraction, "host": host, "gpu_blocks": report.primary_blocks,
                "hit": {n: r.hit_rate for n, r in report.results.items()},
                "belady": (report.belady_total or report.belady_gpu).hit_rate,
                "age_ceiling": report.age_ceiling_gpu,
                "held": {p.name: (p.held_requests, p.clipped_requests) for p in policies if hasattr(p, "held_requests")},
                "demote": {n: (r.demote_requests, r.demote_computed_tokens, r.demote_uncached, r.demote_skipped)
                           for n, r in report.results.items() if n in DEMOTE},
            })
    out["seconds"] = time.perf_counter() - started
    return out


DIAGNOSTIC = "lru+conv, whole quota (diagnostic)"


def _whole_quota():  # noqa: ANN202 - a SimPolicy
    """``lru+conv`` in a class whose holds may fill the tenant's whole quota (``hint_quota_fraction``
    1.0): not a candidate, a measurement of what the default share's budget costs."""
    from retention.policy.hint_plan import HintPolicy
    from retention.simulation.conversational import ConversationPolicy
    from retention.simulation.sim_policies import make_policy

    rules = HintPolicy(enabled=True, quota_fraction=1.0)
    return ConversationPolicy(make_policy("lru"), rules=lambda request: rules, label=DIAGNOSTIC)


def run_grid(name: str = "chat", fraction: float = 0.02) -> list[dict]:
    """The hold's knob on the tune family: adaptive+conv and lru+conv at each (quantile, margin)."""
    from retention.policy.conversation import ConversationLedger
    from retention.simulation.conversational import ConversationPolicy
    from retention.simulation.sim_policies import make_policy
    from retention.simulation.simulator import simulate
    from retention.trace import distinct_blocks

    requests, deletions = load(name)
    gpu = max(1, round(fraction * distinct_blocks(requests)))
    rows = []
    for quantile, margin in GRID:
        row = {"quantile": quantile, "margin": margin}
        for base in ("lru", "adaptive"):
            policy = ConversationPolicy(make_policy(base), ledger=ConversationLedger(quantile=quantile, margin=margin))
            row[base] = simulate(requests, policy, primary_blocks=gpu, secondary_blocks=0, deletions=deletions).hit_rate
        rows.append(row)
    return rows


def held_note(result: dict) -> str:
    """Requests the hold changed and those the hint budget cut short, per conv policy (first setting)."""
    held = result["settings"][0]["held"] if result["settings"] else {}
    if not any(h for h, _ in held.values()):
        return ""
    return "; held / cut short by the budget: " + ", ".join(f"{n} {h:,} / {c:,}" for n, (h, c) in held.items())


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def table(results: list[dict], role: dict[str, str]) -> list[str]:
    lines = ["| family (role) | GPU | host | policy | hit rate | ×LRU | % of Belady |", "|---|---:|---:|---|---:|---:|---:|"]
    for result in results:
        for s in result["settings"]:
            hit, lru, belady = s["hit"], s["hit"]["lru"], s["belady"]
            best = max(AGE_BASED, key=lambda n: hit[n])
            rows = [(n, hit[n]) for n in hit if not (s["host"] == 0 and n.startswith("trtllm-default"))]
            rows.append((f"best age-based ({best})", hit[best]))
            rows.append(("Belady" + (" (GPU + host)" if s["host"] else ""), belady))
            for label, value in rows:
                lines.append(
                    f"| {result['name']} ({role[result['name']]}) | {100 * s['fraction']:g} % ({s['gpu_blocks']:,}) | "
                    f"{s['host']}× | {label} | {pct(value)} | {value / lru:.3f} | {100 * value / belady:.1f} % |"
                    if lru and belady else
                    f"| {result['name']} ({role[result['name']]}) | {100 * s['fraction']:g} % | {s['host']}× | {label} | "
                    f"{pct(value)} | – | – |")
    return lines


def checks(results: list[dict]) -> tuple[list[str], dict]:
    """The targets, from the figures: agent-loop ≥ 1.3 × lru at 2 % GPU only; conv never below the best age-based."""
    lines, verdict = [], {"target": None, "below_best": []}
    for result in results:
        for s in result["settings"]:
            hit = s["hit"]
            best = max(hit[n] for n in AGE_BASED)
            for conv in CONV:
                if hit[conv] < best:
                    verdict["below_best"].append((result["name"], s["fraction"], s["host"], conv, hit[conv] - best))
            if result["name"] == TARGET_FAMILY and s["fraction"] == 0.02 and s["host"] == 0:
                conv = max(CONV, key=lambda n: hit[n])
                ratio = hit[conv] / hit["lru"] if hit["lru"] else 0.0
                ceiling = s["belady"] / hit["lru"] if hit["lru"] else 0.0
                verdict["target"] = {"policy": conv, "ratio": ratio, "belady_ratio": ceiling}
                met = ratio >= TARGET_RATIO
                lines.append(
                    f"**Target, {TARGET_FAMILY} at 2 % GPU only:** {conv} is {ratio:.3f} × lru "
                    f"({'met' if met else f'not met: short by {TARGET_RATIO - ratio:.3f} ×'}). Belady, which knows "
                    f"the future, reaches {ceiling:.3f} × lru here"
                    + (f", so no policy can reach {TARGET_RATIO} × on this family." if ceiling < TARGET_RATIO else "."))
    below = verdict["below_best"]
    if below:
        worst = min(below, key=lambda b: b[4])
        lines.append(
            f"**Never below the best age-based policy:** not met in {len(below)} of "
            f"{sum(len(r['settings']) for r in results) * len(CONV)} (family, setting, conv policy) cells; the "
            f"largest shortfall is {100 * worst[4]:+.2f} points ({worst[3]} on {worst[0]}, GPU {100 * worst[1]:g} %, "
            f"host {worst[2]}×). Cells: " + "; ".join(f"{b[0]} {b[3]} {100 * b[4]:+.2f}" for b in below) + ".")
    else:
        lines.append("**Never below the best age-based policy:** met in every (family, setting) for both conv policies.")
    return lines, verdict


def reading(results: list[dict]) -> list[str]:
    """Why, from the figures: each conv policy against its own base where conversations are, and the diagnostic."""
    parts = []
    for result in results:
        for s in result["settings"]:
            hit = s["hit"]
            if DIAGNOSTIC not in hit:
                continue
            deltas = ", ".join(f"{c} {100 * (hit[c] - hit[c.removesuffix('+conv')]):+.2f}" for c in CONV)
            cut = s["held"].get("lru+conv", (0, 0))
            parts.append(
                f"{result['name']} (GPU {100 * s['fraction']:g} %, host {s['host']}×): against their own base {deltas} "
                f"points; lru+conv changed {cut[0]:,} plans and the budget cut {cut[1]:,} holds short or off; with the whole quota "
                f"allowed lru+conv reaches {pct(hit[DIAGNOSTIC])} ({hit[DIAGNOSTIC] / hit['lru']:.3f} × lru)")
    if not parts:
        return []
    return ["Reading: " + "; ".join(parts) + ". Where every request is a conversation of one kind, a hold of "
            "the same length for all is LRU's own order (held = used within the hold), so a hold can only "
            "reorder where the budget cuts it: a cut-short prefix keeps its tail at 35 while blocks of conversations "
            "that already ended stay held, and TensorRT-LLM's expiry puts a block whose hold ran out back at the "
            "most recent end of priority 35 (`LRUEvictionPolicy::refresh`, modelled by the pool), so an ended "
            "conversation's blocks outlive LRU by the hold. A delete cannot revoke a hold already sent; a demote request re-claims what is still cached of it at priority 0 (+demote rows). Only "
            "where held conversations compete with requests that are not held (one-shot traffic, another kind) "
            "can the hold change the order usefully; the agent-loop and chat families have no such traffic, "
            "and that case is not measured here."]


def demote_lines(results: list[dict]) -> list[str]:
    """Demote on delete against the hold alone, per family and setting where deletes exist; elsewhere
    whether every +demote row equals its +conv row."""
    parts, same = [], []
    for result in results:
        for s in result["settings"]:
            hit = s["hit"]
            if not result["deletions"]:
                same.append(all(hit[d] == hit[d.removesuffix("+demote")] for d in DEMOTE))
                continue
            cells = []
            for d in DEMOTE:
                base = d.removesuffix("+demote")
                sent, computed, uncached, skipped = s["demote"][d]
                cells.append(f"{d} {pct(hit[d])} vs {base} {pct(hit[base])} ({100 * (hit[d] - hit[base]):+.2f} points; "
                             f"{sent:,} demote requests, {computed:,} computed prompt tokens, {uncached:,} deletes with "
                             f"nothing of their own cached, {skipped:,} without room)")
            parts.append(f"{result['name']} (GPU {100 * s['fraction']:g} %, host {s['host']}×): " + "; ".join(cells))
    lines = []
    if parts:
        lines.append("**Demote on delete** (of "
                     f"{sum(r['deletions'] for r in results if r['deletions']):,} deletes, one request per deleted chain "
                     "at most: a response whose blocks all sit in a later live response demotes nothing): "
                     + "; ".join(parts) + ".")
    if same:
        lines.append(f"Families without deletes: +demote equals +conv in {sum(same)} of {len(same)} settings.")
    return lines


def run(workers: int, fractions: tuple[float, ...], hosts: tuple[int, ...], only: list[str] | None,
        grid: bool, limit: int | None = None) -> tuple[str, dict]:
    role = roles()
    names = [n for n in role if only is None or n in only]
    order = {n: i for i, n in enumerate(["agent-loop", "chat"] + sorted(role))}
    names.sort(key=lambda n: order[n])
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_family, n, fractions, hosts, limit) for n in names]
        grid_future = pool.submit(run_grid) if grid else None
        results = [f.result() for f in futures]
        grid_rows = grid_future.result() if grid_future is not None else []
    seconds = time.perf_counter() - started
    check_lines, verdict = checks(results)
    lines = [
        "## Conversation-aware retention (stored conversations and tool loops)",
        "",
        seed_line(SEED, "every generated family's `generate(seed)`: sessions, runs, think and tool times, deletions"),
        "",
        "`bench/conversation.py`: requests that offer tools or store their response (OpenAI Responses) held at "
        "priority 60 for the tenant's measured median gap (tool-call gaps and chat-turn gaps apart, measured from "
        "`previous_response_id` chains), prompt and decode retention, within a class allowing 1 h and half of "
        "the pool (`retention/policy/conversation.py`); for `X+conv` deletions reach only the ledger (TensorRT-LLM "
        "cannot revoke a duration given at enqueue, so the simulated pool cannot either). `X+conv` = policy X with the "
        "hold on top; on families without Responses fields it plans exactly as X. `X+conv+demote` = the same, and a "
        "delete becomes a demote request replayed through the pool (`retention/policy/demote.py`): the deleted "
        "prompt cut to its cached blocks + 1 token, one token generated, with priority 0 and no expiry from the "
        "first block no other live stored response of the tenant holds (TensorRT-LLM re-sets a matched block's "
        "priority and duration from the reusing request: `WindowBlockManager::loadOrAllocateBlocks` → "
        "`LRUEvictionPolicy::claimBlock`); demote requests are counted apart, never in the hit rate. Best age-based = the best of lru, "
        "adaptive-bands, protect and adaptive in that setting. Belady knows the future (a ceiling, not a policy). "
        "Generated tokens are not cached in the simulator, so the decode hold costs budget and earns nothing here.",
        "",
        *(f"- {r['name']}: {r['requests']:,} requests, {r['responses']:,} with a response id, {r['tools']:,} offering "
          f"tools, {r['deletions']:,} deletions ({r['seconds']:.0f} s)" + held_note(r) for r in results),
        "",
        *table(results, role),
        "",
        *check_lines,
        "",
        *demote_lines(results),
        "",
        *reading(results),
        "",
    ]
    if grid_rows:
        chat = next((s["hit"] for r in results if r["name"] == "chat" for s in r["settings"]
                     if s["fraction"] == 0.02 and s["host"] == 0), None)
        there = "" if chat is None else " (" + ", ".join(f"{n} {pct(chat[n])}" for n in AGE_BASED) + " there)"
        chosen = next(g for g in grid_rows if (g["quantile"], g["margin"]) == CHOSEN)
        best = max(grid_rows, key=lambda g: g["adaptive"])
        lines += [f"The hold's knob, tuned on `chat` (tune family) at 2 % GPU only{there}, by adaptive+conv (the "
                  f"gateway's default policy with the hold): the rule kept is p{100 * CHOSEN[0]:g} × {CHOSEN[1]:g} "
                  f"(hold for the median gap), {100 * (best['adaptive'] - chosen['adaptive']):.2f} points below the "
                  f"best row there (p{100 * best['quantile']:g} × {best['margin']:g}); for lru+conv the best row is "
                  f"{100 * (max(g['lru'] for g in grid_rows) - chosen['lru']):.2f} points above it. The hints' own "
                  "rule (p90 × 2) is the first row:", "",
                  "| quantile × margin | lru+conv | adaptive+conv |", "|---|---:|---:|"]
        lines += [f"| p{100 * g['quantile']:g} × {g['margin']:g} | {pct(g['lru'])} | {pct(g['adaptive'])} |"
                  for g in grid_rows]
        lines.append("")
    lines.append(f"{sum(len(r['settings']) for r in results)} settings, {seconds:.0f} s with {workers} workers "
                 f"({machine()}, shared).")
    return "\n".join(lines), {"results": results, "grid": grid_rows, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS), help="GPU shares, comma-separated")
    parser.add_argument("--hosts", default=",".join(str(h) for h in HOSTS), help="host multiples of the GPU, comma-separated")
    parser.add_argument("--only", default=None, help="families, comma-separated")
    parser.add_argument("--no-grid", action="store_true", help="skip the knob grid on chat")
    parser.add_argument("--limit", type=int, default=None, help="the first N requests of each family (a quick look)")
    args = parser.parse_args()
    fractions = tuple(float(x) for x in args.fractions.split(","))
    hosts = tuple(int(x) for x in args.hosts.split(","))
    section, raw = run(args.workers, fractions, hosts, args.only.split(",") if args.only else None, not args.no_grid,
                       args.limit)
    print(section)
    print(json.dumps(raw, indent=2, default=str), file=sys.stderr)
    if not args.no_write and args.limit is None:
        write_section("conversation", section)


if __name__ == "__main__":
    main()
