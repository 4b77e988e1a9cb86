"""Conversation-aware retention measured: every workload family, next to LRU, the age-based policies and Belady.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/conversation.py [--no-write] [--workers 2] [--fractions 0.02]
[--hosts 0] [--only a,b] [--wide-fractions 0.01,0.02,0.05] [--wide-hosts 0,4]``

Writes the ``bench:conversation`` section of docs/benchmarks.md. Deterministic: every generated
family is drawn with seed 0 (``bench/retention/generalize.py``'s), the public synthetic trace is read as is.

* Families (``retention/workloads/__init__.py``, roles tune / report): ``agent-loop`` (agent
  runs as Responses chains, tools offered at every step, half the runs deleted when they end),
  ``chat`` (stored Responses conversations, half deleted after their last turn) and every
  other family (no conversation fields: there ``X+conv`` plans exactly as ``X``).
* Capacity: every family at GPU 2 % of the trace's distinct 512-token blocks (``--fractions``),
  host 0 (``--hosts``); the conversation families (``agent-loop``, ``chat``, ``agent-mixed``,
  :data:`WIDE`) also at GPU 1 % and 5 % with host 0, and at GPU 2 % with host 4×
  (``--wide-fractions`` at the first host multiple, ``--wide-hosts`` at the first GPU share: a
  cross, not the product, to bound the run time; with a host tier ``trtllm-default`` and
  ``trtllm-default+conv`` are added).
* Policies (``kvgate simulate`` names): ``lru``; ``trtllm-default`` (at host 0 it *is* lru:
  every block at 35, nowhere to offload, so its row is lru's); the age-based policies
  ``adaptive-bands``, ``protect`` and ``adaptive`` (selection among them, the gateway's
  default), whose best per setting is "best age-based"; conversation-aware ``lru+conv`` and
  ``adaptive+conv`` (``retention/simulation/conversational.py``: requests offering tools or
  storing their response held at priority 60 for the tenant's measured median gap, within a
  class allowing 1 h and half of the pool); ``lru+conv+demote`` and ``adaptive+conv+demote``
  (the same, and every delete replayed through the pool as the gateway's demote requests, one
  per orphaned leaf, by the gateway's rule: ``retention/policy/demote.py``'s ``doomed``; its
  requests and computed tokens are counted apart, never in
  the hit rate); ``lru+conv+end`` and ``adaptive+conv+end`` (and a tool-offering request whose
  response is a message, i.e. its run ended, answered at completion by a demote request for
  its conversation's own blocks, where the hold duel holds its conversation); ``lru+end``,
  ``protect+end`` and ``adaptive+end`` (that end demote alone, without the hold: X's plans
  unchanged, every run that ends in a message demoted, no duel to gate it; ``adaptive+end`` is
  the configuration the gateway recommends for agent tool loops); diagnostics, not
  candidates: ``lru+conv`` without the duel (every eligible request held), ``lru+conv+end``
  with the end demote ungated (every run that ends), and ``lru+conv`` allowed the whole quota;
  Belady as the ceiling (GPU; GPU + host with a host tier).
* The hold's duel (``retention/policy/hold_duel.py``) is on in every ``+conv`` policy, as in
  the gateway.
* Columns: hit rate (prompt tokens served from cache), ×LRU, % of Belady.
* Verdicts: "never below its own base X" for every candidate; "never below the best age-based
  policy" for ``adaptive+end`` (the recommended configuration) and, apart, for the hold variants
  (``adaptive+conv``, ``+conv+demote``, ``+conv+end``).

The hold's knob (quantile × margin of the measured gaps) was chosen on ``chat`` (tune) only;
the grid is run again here (``--grid``) and printed with the section.
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

from bench.report import machine, seed_line, synthetic_trace, write_section  # noqa: E402
from retention.policy.conversation import GAP_MARGIN, GAP_QUANTILE  # noqa: E402

SEED = 0
FRACTIONS = (0.02,)
HOSTS = (0,)
WIDE = ("agent-loop", "chat", "agent-mixed")  # the conversation families, measured at more settings
WIDE_FRACTIONS = (0.01, 0.02, 0.05)
WIDE_HOSTS = (0, 4)
AGE_BASED = ("lru", "adaptive-bands", "protect", "adaptive")
CONV = ("lru+conv", "adaptive+conv")
DEMOTE = ("lru+conv+demote", "adaptive+conv+demote")  # the same, each delete replayed as a demote request
END = ("lru+conv+end", "adaptive+conv+end")  # the hold, and a run ended in a message demoted at completion
END_ONLY = ("lru+end", "protect+end", "adaptive+end")  # that end demote without the hold (no duel gates it)
RECOMMENDED = "adaptive+end"  # what the gateway recommends for agent tool loops: judged against the best age-based
CANDIDATES = CONV + DEMOTE + END + END_ONLY  # each against its own base X (lru, protect or adaptive)
HOLD_VARIANTS = tuple(n for n in CANDIDATES if n.startswith("adaptive+conv"))  # judged apart
NOISE_POINTS = 0.25  # "never below X": X+... may fall at most this many points below X
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
                 "tools": sum(r.offers_tools for r in requests),
                 "messages": sum(r.output_kind == "message" for r in requests), "settings": []}
    started = time.perf_counter()
    conversational = bool(out["responses"] or out["tools"])
    out["copied"] = not conversational
    for host in hosts:
        names = list(AGE_BASED) + (["trtllm-default"] if host else [])
        if conversational:  # elsewhere every X+... plans exactly as X (run time: not replayed, copied below)
            names += list(CANDIDATES) + (["trtllm-default+conv"] if host else [])
        factories = [lambda n=n: make_policy(n) for n in names]
        if conversational:
            factories += [_no_duel, _end_ungated, _whole_quota]
        made: list = []  # every policy instance, in creation order (names per capacity)
        gpus = [max(1, round(f * distinct)) for f in fractions]
        reports = run_simulation(requests, [lambda f=f: made.append(f()) or made[-1] for f in factories], gpus,
                                 host_blocks=lambda g, h=host: g * h, deletions=deletions)
        for index, (fraction, report) in enumerate(zip(fractions, reports)):
            policies = made[index * len(factories):(index + 1) * len(factories)]
            out["settings"].append({
                "fraction": fraction, "host": host, "gpu_blocks": report.primary_blocks,
                "hit": _with_copies({n: r.hit_rate for n, r in report.results.items()}, conversational),
                "belady": (report.belady_total or report.belady_gpu).hit_rate,
                "age_ceiling": report.age_ceiling_gpu,
                "held": {p.name: (p.held_requests, p.clipped_requests) for p in policies if hasattr(p, "held_requests")},
                "duel": {p.name: (p.ledger.duel.arm, p.ledger.duel.switches, p.ledger.duel.standings())
                         for p in policies if getattr(getattr(p, "ledger", None), "duel", None) is not None},
                "ends": {p.name: p.end_demotes for p in policies if getattr(p, "end_demotes", 0)},
                "demote": {n: (r.demote_requests, r.demote_computed_tokens, r.demote_uncached, r.demote_skipped)
                           for n, r in report.results.items()
                           if n in DEMOTE or n in END or n in END_ONLY or n == END_UNGATED},
            })
    out["seconds"] = time.perf_counter() - started
    return out


def _with_copies(hit: dict[str, float], conversational: bool) -> dict[str, float]:
    """Without conversation fields ``X+conv``, ``+demote`` and ``+end`` plan exactly as X (no request has a
    field to act on; ``tests/retention/test_conversation_sim.py`` replays it): their figures are X's."""
    if conversational:
        return hit
    out = dict(hit)
    for name in (*CANDIDATES, "trtllm-default+conv"):
        if base_of(name) in hit:
            out[name] = hit[base_of(name)]
    return out


NO_DUEL = "lru+conv, no duel (diagnostic)"
END_UNGATED = "lru+conv+end, end demote ungated (diagnostic)"


def _no_duel():  # noqa: ANN202 - a SimPolicy
    """``lru+conv`` holding every eligible request (the hold without its duel): what the duel changes."""
    from retention.policy.conversation import ConversationLedger
    from retention.simulation.conversational import ConversationPolicy
    from retention.simulation.sim_policies import make_policy

    return ConversationPolicy(make_policy("lru"), ledger=ConversationLedger(duel=None), label=NO_DUEL)


def _end_ungated():  # noqa: ANN202 - a SimPolicy
    """``lru+conv+end`` demoting every run that ends in a message, whatever the duel says."""
    from retention.simulation.sim_policies import make_policy

    policy = make_policy("lru+conv+end")
    policy.label, policy.end_demote = END_UNGATED, "always"  # type: ignore[attr-defined]
    return policy


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
    """The hold's knob on the tune family: adaptive+conv and lru+conv at each (quantile, margin), without
    the duel (the knob of the hold itself)."""
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
            policy = ConversationPolicy(make_policy(base), ledger=ConversationLedger(quantile=quantile, margin=margin, duel=None))
            row[base] = simulate(requests, policy, primary_blocks=gpu, secondary_blocks=0, deletions=deletions).hit_rate
        rows.append(row)
    return rows


def held_note(result: dict) -> str:
    """Requests the hold changed and those the hint budget cut short (first setting), and the duel's end state."""
    first = result["settings"][0] if result["settings"] else None
    if first is None or not any(h for h, _ in first["held"].values()):
        return ""
    held = first["held"]
    parts = [f"{n} {held[n][0]:,} / {held[n][1]:,}" for n in (*CONV, NO_DUEL) if n in held]
    duel = first["duel"].get("lru+conv")
    arm = "" if duel is None else (
        f"; lru+conv's duel ends on \"{duel[0]}\" after {duel[1]} switch(es), its shadows' hit ratios held "
        f"{pct(duel[2]['always'])} / not held {pct(duel[2]['never'])}")
    return "; held / cut short by the budget: " + ", ".join(parts) + arm


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def base_of(name: str) -> str:
    return name.split("+", 1)[0]


def table(results: list[dict], role: dict[str, str]) -> list[str]:
    """Every family, every policy, at the first setting (GPU 2 %, host 0)."""
    lines = ["| family (role) | GPU | host | policy | hit rate | ×LRU | % of Belady |", "|---|---:|---:|---|---:|---:|---:|"]
    for result in results:
        for s in result["settings"][:1]:
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


WIDE_COLUMNS = ("lru", "adaptive", *CONV, *END, END_UNGATED, *END_ONLY)


def wide_table(results: list[dict]) -> list[str]:
    """The conversation families at every setting: hit rates of the main rows (×LRU in brackets)."""
    heads = ["lru", "best age-based", "adaptive", *CONV, *END, "end ungated (diag.)", *END_ONLY, "Belady"]
    lines = ["| family | GPU | host | " + " | ".join(heads) + " |", "|---|---:|---:|" + "---:|" * len(heads)]
    for result in results:
        if len(result["settings"]) < 2:
            continue
        for s in result["settings"]:
            hit, lru = s["hit"], s["hit"]["lru"]
            best = max(AGE_BASED, key=lambda n: hit[n])
            values = [hit["lru"], hit[best], *(hit[n] for n in WIDE_COLUMNS[1:]), s["belady"]]
            cells = [f"{100 * v:.2f} ({v / lru:.3f}×)" if lru else f"{100 * v:.2f}" for v in values]
            cells[1] = f"{cells[1]} {best}"
            lines.append(f"| {result['name']} | {100 * s['fraction']:g} % ({s['gpu_blocks']:,}) | {s['host']}× | "
                         + " | ".join(cells) + " |")
    return lines


def checks(results: list[dict]) -> tuple[list[str], dict]:
    """The targets, from the figures: agent-loop ≥ 1.3 × lru at 2 % GPU only; never below X (within
    NOISE_POINTS); never below the best age-based policy."""
    verdict = {"target": None, "below_base": [], "below_best": [], "below_best_hold": [], "cells": 0,
                      "recommended_cells": 0, "hold_cells": 0}
    lines = []
    for result in results:
        for s in result["settings"]:
            hit = s["hit"]
            best = max(hit[n] for n in AGE_BASED)
            for cand in CANDIDATES:
                verdict["cells"] += 1
                delta = hit[cand] - hit[base_of(cand)]
                if delta < -NOISE_POINTS / 100:
                    verdict["below_base"].append((result["name"], s["fraction"], s["host"], cand, delta))
                key = "below_best" if cand == RECOMMENDED else "below_best_hold" if cand in HOLD_VARIANTS else None
                if key is None:
                    continue
                verdict["recommended_cells" if cand == RECOMMENDED else "hold_cells"] += 1
                if hit[cand] < best - NOISE_POINTS / 100:
                    verdict[key].append((result["name"], s["fraction"], s["host"], cand, hit[cand] - best))
            if result["name"] == TARGET_FAMILY and s["fraction"] == 0.02 and s["host"] == 0:
                cand = max(CANDIDATES, key=lambda n: hit[n])
                ratio = hit[cand] / hit["lru"] if hit["lru"] else 0.0
                ceiling = s["belady"] / hit["lru"] if hit["lru"] else 0.0
                gap = s["belady"] - hit["lru"]
                verdict["target"] = {"policy": cand, "ratio": ratio, "belady_ratio": ceiling}
                met = ratio >= TARGET_RATIO
                lines.append(
                    f"**Target, {TARGET_FAMILY} at 2 % GPU only:** the best candidate, {cand}, is {ratio:.3f} × lru "
                    f"({'met' if met else f'not met: short by {TARGET_RATIO - ratio:.3f} ×'}). **The target is above "
                    f"this family's ceiling:** Belady, which knows the future, reaches {ceiling:.3f} × lru here, so no "
                    f"policy can reach {TARGET_RATIO} ×; {cand} closes "
                    f"{100 * (hit[cand] - hit['lru']) / gap if gap > 0 else 0:.0f} % of the gap between lru and Belady "
                    f"({pct(hit['lru'])} → {pct(hit[cand])} of {pct(s['belady'])}).")

    def cells(items: list) -> str:
        return "; ".join(f"{b[0]} {100 * b[1]:g} %/{b[2]}× {b[3]} {100 * b[4]:+.2f}" for b in items)

    for key, what, total in (
            ("below_best", f"the best age-based policy, for the configuration the gateway recommends for agent tool "
             f"loops ({RECOMMENDED}: adaptive with the run's-end demote, without the hold)",
             verdict["recommended_cells"]),
            ("below_base", "its own base X (lru, protect or adaptive), every candidate", verdict["cells"]),
            ("below_best_hold", "the best age-based policy, for the hold variants (the gateway's default, adaptive, "
             "with the hold: " + ", ".join(HOLD_VARIANTS) + ")", verdict["hold_cells"])):
        below = verdict[key]
        if below:
            lines.append(f"**Never below {what}, within {NOISE_POINTS} points:** not met in {len(below)} of "
                         f"{total} (family, setting, candidate) cells: {cells(below)}.")
        else:
            lines.append(f"**Never below {what}, within {NOISE_POINTS} points:** met in all {total} "
                         "(family, setting, candidate) cells.")
    return lines, verdict


def reading(results: list[dict]) -> list[str]:
    """Why, from the figures: the duel against holding everything, and the end demote."""
    parts = []
    for result in results:
        s = result["settings"][0] if result["settings"] else None
        if s is None or NO_DUEL not in s["hit"]:
            continue
        hit = s["hit"]
        parts.append(
            f"{result['name']} (GPU {100 * s['fraction']:g} %, host {s['host']}×): lru {pct(hit['lru'])}, every eligible "
            f"request held {pct(hit[NO_DUEL])}, with the duel {pct(hit['lru+conv'])}; the end demote through the "
            f"duel {pct(hit['lru+conv+end'])}, ungated {pct(hit[END_UNGATED])}; the end demote without the hold "
            + ", ".join(f"{n} {pct(hit[n])}" for n in END_ONLY) + f"; the hold with the whole quota "
            f"{pct(hit[DIAGNOSTIC])}")
    if not parts:
        return []
    return [
        "Reading: " + "; ".join(parts) + ".",
        "",
        "*The duel.* Two sampled shadows of the pool (the adaptive selector's shadows, same sampling and switch "
        "rule: 5 % of the block-hash space or at least 64 GPU blocks; a 3 % lead for 100 sampled references after "
        "300) replay every request of the pool, one with the plan each request gets without the hold and one with "
        "the plan it would get held (from a budget of its own); the pool holds while the held shadow hits more. Each "
        "shadow holds one arm for everybody, so the contest measures the pool's gain from holding, not a "
        "conversation's private gain from being held. The set dueling it replaced (an always-hold and a never-hold "
        "set of conversations sharing the real pool) measured the private gain, so its always-set won on every "
        "family with conversations and the pool held where holding costs it (chat 5 %: 1.50 points below lru; "
        "agent-loop 2 %: 1.07). An unbiased comparison in time (epochs of 64 requests, one in four on the other "
        "arm; seed 0, GPU 2 %, not in the bench) cost more than it found: chat 33.64 % against lru's 36.01 % (a "
        "prefix held in one epoch outranks the next epoch's unheld ones).",
        "",
        "*Where Belady's extra hits come from.* A tool loop's run ends; its last step's blocks (and its whole "
        "history) are never used again, but LRU keeps them until they age out, and the hold keeps them longer. The "
        "gateway knows when it happens: a tool-offering request whose response is a message rather than a function "
        "call (the trace's `output_kind`) ended the run, or waits for a human. The end demote answers that completion "
        "with one demote request (the same as on delete: cached blocks + 1 token, priority 0 from the first block no "
        "other conversation's live stored response holds). It cannot revoke a hold either, but it re-claims the "
        "blocks after it; through the duel it runs only while the hold does, ungated it runs for every run that ends; `X+end` runs it for every run that ends and holds "
        "nothing, so the pool's own order (lru's, protect's, adaptive's) is left as it was and only the finished "
        "runs' blocks go first. A run that only waits for a human loses its history "
        "(5 % of steps in agent-loop ask).",
    ]


def demote_lines(results: list[dict]) -> list[str]:
    """Demote on delete and at a run's end: the requests and computed tokens, per family (first setting)."""
    parts = []
    for result in results:
        s = result["settings"][0] if result["settings"] else None
        if s is None or not (result["deletions"] or result["messages"]):
            continue
        hit = s["hit"]
        cells = []
        for d in (*DEMOTE, *END, END_UNGATED, *END_ONLY):
            if d not in s["demote"]:
                continue
            base = "lru+conv" if d == END_UNGATED else d.removesuffix("+demote").removesuffix("+end")
            sent, computed, uncached, skipped = s["demote"][d]
            cells.append(f"{d} {pct(hit[d])} vs {base} {pct(hit[base])} ({100 * (hit[d] - hit[base]):+.2f} points; "
                         f"{sent:,} demote requests, {computed:,} computed prompt tokens, {uncached:,} with nothing "
                         f"of their own cached, {skipped:,} without room)")
        parts.append(f"{result['name']} (GPU {100 * s['fraction']:g} %, host {s['host']}×; {result['deletions']:,} "
                     f"deletes, {result['messages']:,} tool-offering responses that are messages): " + "; ".join(cells))
    return ["**Demote requests** (on delete: one per orphaned leaf whose chain can still be rebuilt, at most 8; "
            "at a run's end: one per run that ends in a message, where allowed; X+end: every such run, no hold): " + "; ".join(parts) + "."] if parts else []


def _cached_family(cache: Path | None, name: str, fractions: tuple[float, ...], host: int, limit: int | None) -> dict:
    """``run_family`` for one host, kept in ``cache`` (a directory) so an interrupted run resumes; the
    cache knows nothing of code changes: empty it when the policies change."""
    path = None if cache is None else cache / f"{name}-{'-'.join(map(str, fractions))}-h{host}-l{limit}-s{SEED}.json"
    if path is not None and path.exists():
        return json.loads(path.read_text())
    result = run_family(name, fractions, (host,), limit)
    if path is not None:
        path.write_text(json.dumps(result))
    return result


def run(workers: int, fractions: tuple[float, ...], hosts: tuple[int, ...], only: list[str] | None,
        grid: bool, limit: int | None = None, wide: tuple[tuple[float, ...], tuple[int, ...]] | None = None,
        cache: Path | None = None) -> tuple[str, dict]:
    """Every family at (fractions × hosts); the WIDE families also at ``wide``'s fractions (first host)
    and hosts (first fraction)."""
    role = roles()
    names = [n for n in role if only is None or n in only]
    first = ["agent-loop", "agent-mixed", "chat"]
    order = {n: i for i, n in enumerate(first + sorted(n for n in role if n not in first))}
    names.sort(key=lambda n: order[n])
    tasks = []  # (family, fractions, host): one per host, so two workers share the big families
    for n in names:
        if wide is not None and n in WIDE:
            # a cross, not a product (run time): the wide GPU shares at the first host multiple, the wide
            # host multiples at the first GPU share
            tasks += [(n, fractions, h) for h in hosts]
            tasks.append((n, tuple(f for f in wide[0] if f not in fractions), hosts[0]))
            tasks += [(n, fractions, h) for h in wide[1] if h not in hosts]
        else:
            tasks += [(n, fractions, h) for h in hosts]
    tasks = [t for t in tasks if t[1]]
    started = time.perf_counter()
    parts: dict[str, list[dict]] = {n: [] for n in names}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_cached_family, cache, n, f, h, limit): (n, f, h) for n, f, h in tasks}
        grid_future = pool.submit(run_grid) if grid else None
        for done, future in enumerate(as_completed(futures), start=1):
            n, f, h = futures[future]
            parts[n].append(future.result())
            print(f"[{time.perf_counter() - started:5.0f} s] {done}/{len(futures)} {n} GPU {f} host {h}×",
                  file=sys.stderr, flush=True)
        grid_rows = grid_future.result() if grid_future is not None else []
    results = []
    for n in names:
        merged = dict(parts[n][0])
        # the first setting (fractions[0], hosts[0]) first, then the rest by host and fraction
        merged["settings"] = sorted((s for p in parts[n] for s in p["settings"]),
                                    key=lambda s: ((s["fraction"], s["host"]) != (fractions[0], hosts[0]), s["host"],
                                                   s["fraction"]))
        merged["seconds"] = sum(p["seconds"] for p in parts[n])
        results.append(merged)
    seconds = time.perf_counter() - started
    check_lines, verdict = checks(results)
    wide_lines = wide_table(results)
    lines = [
        "## Conversation-aware retention (stored conversations and tool loops)",
        "",
        seed_line(SEED, "every generated family's `generate(seed)`: sessions, runs, think and tool times, deletions"),
        "",
        "`bench/retention/conversation.py`: requests that offer tools or store their response (OpenAI Responses) held at "
        "priority 60 for the tenant's measured median gap (tool-call gaps and chat-turn gaps apart, measured from "
        "`previous_response_id` chains), prompt and decode retention, within a class allowing 1 h and half of "
        "the pool (`retention/policy/conversation.py`), while the hold's duel holds (the pool's arm) "
        "(`retention/policy/hold_duel.py`); for `X+conv` deletions reach only the ledger (TensorRT-LLM "
        "cannot revoke a duration given at enqueue, so the simulated pool cannot either). `X+conv` = policy X with the "
        "hold on top; on families without Responses fields it plans exactly as X, so there its rows (and +demote's, "
        "+end's) are X's figures, not replayed again (run time; `tests/retention/test_conversation_sim.py` replays "
        "the equality). `X+conv+demote` = the same, and a "
        "delete becomes the gateway's demote requests replayed through the pool, by the gateway's rule "
        "(`retention/policy/demote.py`'s `doomed`): one per orphaned leaf of the deleted response (itself and its "
        "descendants, which can no longer be continued; at most 8, those whose chain can still be rebuilt), its "
        "prompt cut to its cached blocks + 1 token, one token generated, with priority 0 and no expiry from the "
        "first block past the system segment that no live stored response of the conversation outside the "
        "orphaned ones holds (TensorRT-LLM re-sets a matched block's "
        "priority and duration from the reusing request: `WindowBlockManager::loadOrAllocateBlocks` → "
        "`LRUEvictionPolicy::claimBlock`). `X+conv+end` = the hold, and a tool-offering request whose response is a "
        "message (not a function call: its run ended) answered at completion by the same kind of demote request for "
        "its conversation's own blocks, while the hold's duel holds. `X+end` = that end demote without "
        "the hold: X's plans unchanged, every run that ends in a message demoted at completion (no hold, so no duel "
        "gates it); `adaptive+end` is the configuration the gateway recommends for agent tool loops, "
        "and the first verdict below judges it. Demote requests are counted apart, "
        "never in the hit rate. Best age-based = the best of lru, adaptive-bands, protect and adaptive in that "
        "setting. Belady knows the future (a ceiling, not a policy). Generated tokens are not cached in the "
        "simulator, so the decode hold costs budget and earns nothing here.",
        "",
        *(f"- {r['name']}: {r['requests']:,} requests, {r['responses']:,} with a response id, {r['tools']:,} offering "
          f"tools ({r['messages']:,} answered with a message), {r['deletions']:,} deletions ({r['seconds']:.0f} s"
          + ("; X+… rows are X's" if r.get("copied") else "") + ")"
          + held_note(r) for r in results),
        "",
        *check_lines,
        "",
        f"Every family at GPU {', '.join(f'{100 * f:g} %' for f in fractions)}, host "
        f"{', '.join(f'{h}×' for h in hosts)}:",
        "",
        *table(results, role),
        "",
        *([f"The conversation families ({', '.join(n for n in WIDE if n in names)}) at every setting: hit rate "
           "(×LRU); with a host tier Belady is GPU + host:", "", *wide_lines, ""] if len(wide_lines) > 2 else []),
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
                  f"gateway's default policy with the hold) without the duel (every eligible request held): the rule kept is p{100 * CHOSEN[0]:g} × {CHOSEN[1]:g} "
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
    parser.add_argument("--cache", type=Path, default=None,
                        help="a directory keeping each (family, host) result, so an interrupted run resumes")
    parser.add_argument("--wide-fractions", default=",".join(str(f) for f in WIDE_FRACTIONS),
                        help="GPU shares for the conversation families (empty: none)")
    parser.add_argument("--wide-hosts", default=",".join(str(h) for h in WIDE_HOSTS),
                        help="host multiples for the conversation families")
    args = parser.parse_args()
    if args.cache is not None:
        if args.cache.exists() and not args.cache.is_dir():
            parser.error(f"--cache {args.cache} is a file, not a directory")
        args.cache.mkdir(parents=True, exist_ok=True)  # before any family runs, not after the first finishes
    fractions = tuple(float(x) for x in args.fractions.split(","))
    hosts = tuple(int(x) for x in args.hosts.split(","))
    wide = None
    if args.wide_fractions:
        wide = (tuple(float(x) for x in args.wide_fractions.split(",")), tuple(int(x) for x in args.wide_hosts.split(",")))
    section, raw = run(args.workers, fractions, hosts, args.only.split(",") if args.only else None, not args.no_grid,
                       args.limit, wide, args.cache)
    print(section)
    print(json.dumps(raw, indent=2, default=str), file=sys.stderr)
    if not args.no_write and args.limit is None:
        write_section("conversation", section)


if __name__ == "__main__":
    main()
