"""The design notes' RAG-chat benchmark, reproduced by model: prefill recomputed per policy.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/rag_chat.py [--no-write] [--scale 16] [--duration 1800]``

Writes the ``bench:rag_chat`` section of docs/benchmarks.md. Deterministic (seeded).

* Capacity: ``kvgate plan`` for Qwen2.5-72B (GQA, 8 KV heads) with FP8 weights and FP8 KV
  on 8 × H200 (TP 8), 32-token blocks, ``free_gpu_memory_fraction`` 0.9, a 4 GiB runtime
  reserve per rank, and a 256 GiB host tier for the replica (32 GiB ``host_cache_size`` per rank).
* Workload: ``retention/workloads/rag_chat.py`` — 1.5K-token system prompt, 8K tokens of
  retrieved context (4 documents of 2K from a shared corpus, Zipf popularity), 200-token user
  turns, 300-token answers, 6 turns per session, 45 s mean think time.
* Load: sessions per second such that the sessions in flight hold 0.5× (light), 1× (medium)
  and 2× (heavy) the GPU KV capacity at their peak prompt length.
* Scale: replaying a full-size replica (188K blocks) takes hours in pure Python, so the
  simulation runs 1/``scale`` of it: GPU and host blocks, session rate and corpus all divided
  by ``scale``. Reuse distances (in blocks) shrink by the same factor as the capacity, and
  time-based rules (durations, adaptive statistics) see the same clock, so hit rates are
  those of the full-size replica up to sampling noise.
* Policies (``kvgate simulate`` names): ``lru`` (GPU only: prefix caching alone),
  ``trtllm-default`` (every block at priority 35, offload threshold 30: everything evicted
  goes to host), ``class`` (kvgate retention class: system 90, context 70 for 120 s, turn 50
  for 60 s, offload threshold 35), ``adaptive`` (measured reuse, no configuration), each with
  the host tier except ``lru``; Belady at GPU + host capacity as the ceiling.
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
from engines.capacity.arithmetic import PlanInputs, plan  # noqa: E402
from engines.capacity.hardware import GIB, Hardware, load_gpu  # noqa: E402
from engines.capacity.shapes import load_shape  # noqa: E402
from retention.workloads.rag_chat import RagChatSpec, rag_chat_trace  # noqa: E402
from retention.simulation.sim_policies import ClassMapping, make_policy  # noqa: E402
from retention.simulation.simulator import SimConfig, run_simulation  # noqa: E402
from retention.trace import parse_trace  # noqa: E402

MODEL, GPU, GPUS, TP, HOST_PER_REPLICA = "qwen2.5-72b", "h200-141gb", 8, 8, 256 * GIB
SEED = 17  # rag_chat_trace: sessions, documents, think times
TOKENS_PER_BLOCK = 32
FULL_CORPUS = 8000  # documents at full scale (16.4M tokens, ~2.7× the GPU KV)
LOADS = (("light", 0.5), ("medium", 1.0), ("heavy", 2.0))
POLICIES = ("lru", "trtllm-default", "class", "adaptive")
RAG_CLASSES = {
    "offload_min_priority": 35,
    "default": "rag",
    "classes": {"rag": {
        "system": {"priority": 90},
        "context": {"priority": 70, "duration_ms": 120_000},
        "turn": {"priority": 50, "duration_ms": 60_000},
        "decode": {"priority": 35},
    }},
}
# The design notes' table: 72B model in FP8 on 8 × H200, the same RAG-chat shape (measured on GPUs).
DESIGN_NOTES = (
    ("vLLM prefix caching alone", "38 %"),
    ("SGLang RadixAttention", "17 %"),
    ("vLLM + LMCache, local CPU + NVMe", "11 %"),
    ("LMCache, shared NVMe across nodes", "6 %"),
)


def capacity_plan():
    return plan(load_shape(MODEL), Hardware(load_gpu(GPU), GPUS, TP, 1, HOST_PER_REPLICA // TP),
                PlanInputs(kv_dtype="fp8", weight_dtype="fp8", tokens_per_block=TOKENS_PER_BLOCK,
                           free_gpu_memory_fraction=0.9, runtime_reserve_bytes=4 * GIB, context_length=8192))


def full_scale_rate(spec: RagChatSpec, gpu_tokens: int, pressure: float) -> float:
    """Sessions/s at which the sessions in flight hold ``pressure`` × the GPU KV at their peak prompt."""
    span = (spec.turns - 1) * spec.turn_gap_s  # mean time from a session's first to its last turn
    return pressure * gpu_tokens / (spec.prompt_tokens(spec.turns) * span)


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def run(scale: int, duration: float) -> tuple[str, dict]:
    cap = capacity_plan()
    # The other reading of "a 256 GB host tier": 256 GiB per rank, as TensorRT-LLM reads
    # host_cache_size (the bundled 70B spec did so before its unit was made explicit): 2 TiB per node.
    big_host = plan(load_shape(MODEL), Hardware(load_gpu(GPU), GPUS, TP, 1, HOST_PER_REPLICA),
                    PlanInputs(kv_dtype="fp8", weight_dtype="fp8", tokens_per_block=TOKENS_PER_BLOCK,
                               free_gpu_memory_fraction=0.9, runtime_reserve_bytes=4 * GIB)).secondary_blocks
    gpu_blocks = cap.primary_blocks // scale
    base = RagChatSpec(duration_s=duration, corpus_docs=FULL_CORPUS // scale)
    mapping = ClassMapping.from_dict(RAG_CLASSES)
    config = SimConfig(tokens_per_block=TOKENS_PER_BLOCK, trace_block_size=base.block_size)
    rows, big_rows, raw = [], [], {}
    started = time.perf_counter()
    total_requests = replays = 0

    def replay(requests, names, host_blocks):
        factories = [lambda n=name: make_policy(n, mapping=mapping, block_size=base.block_size) for name in names]
        (report,) = run_simulation(requests, factories, [gpu_blocks], host_blocks=lambda _c: host_blocks, config=config)
        recompute = {name: 1.0 - report.results[name].hit_rate for name in names}
        recompute["belady"] = 1.0 - (report.belady_total or report.belady_gpu).hit_rate
        return recompute, {name: report.results[name].host_hit_rate for name in names}

    for label, pressure in LOADS:
        full_rate = full_scale_rate(base, cap.primary_tokens, pressure)
        spec = RagChatSpec(duration_s=duration, sessions_per_s=full_rate / scale, corpus_docs=FULL_CORPUS // scale)
        lines = rag_chat_trace(spec, seed=SEED)
        requests = parse_trace([json.dumps(line) for line in lines], block_size=spec.block_size)
        total_requests += len(requests)
        recompute, host_share = replay(requests, POLICIES, cap.secondary_blocks // scale)
        big_recompute, big_host_share = replay(requests, POLICIES[1:], big_host // scale)
        replays += len(POLICIES) + len(POLICIES) - 1
        raw[label] = {"pressure": pressure, "sessions_per_s_full_scale": full_rate, "requests": len(requests),
                      "recompute": recompute, "host_hit_rate": host_share,
                      "big_host": {"recompute": big_recompute, "host_hit_rate": big_host_share}}
        rows.append((label, pressure, full_rate, full_rate * spec.turns, len(requests), recompute, host_share))
        big_rows.append((label, pressure, big_recompute, big_host_share))
    seconds = time.perf_counter() - started

    lines = [
        "## RAG chat by model: prefill recomputed (bench/retention/rag_chat.py)",
        "",
        seed_line(SEED, "`rag_chat_trace(spec, seed=...)`: sessions, documents, think times"),
        "",
        "**Ours are simulated**: the same block-pool model the engine uses (`kvgate simulate`,",
        "`retention/`), replaying a synthetic trace — no GPU, no timing. The design notes' figures",
        "were measured on GPUs with other engines; the shapes match, the methods do not.",
        "",
        f"Capacity from `kvgate plan {MODEL} --gpu h200 --tp 8 --weights fp8 --kv-dtype fp8 --host-memory 256GiB`:",
        f"{cap.kv_bytes_per_token:,} KV bytes/token (FP8), {cap.weight_bytes / GIB:.1f} GiB of weights "
        f"({cap.weight_bytes_per_rank / GIB:.2f} GiB per rank), {cap.kv_bytes_per_rank / GIB:.1f} GiB of KV per rank "
        f"⇒ **{cap.primary_blocks:,} GPU blocks** of {TOKENS_PER_BLOCK} tokens ({cap.primary_tokens / 1e6:.2f} M tokens) and "
        f"**{cap.secondary_blocks:,} host blocks** (32 GiB `host_cache_size` per rank) per replica.",
        "",
        f"Workload (`retention/workloads/rag_chat.py`): {base.system_tokens:,}-token system prompt, "
        f"{base.context_tokens:,} tokens of retrieved context ({base.docs_per_session} documents of "
        f"{base.tokens_per_doc:,} tokens, Zipf {base.popularity_skew:g} over {FULL_CORPUS:,} documents), "
        f"{base.user_tokens}-token user turns, {base.answer_tokens}-token answers, {base.turns} turns per session, "
        f"{base.turn_gap_s:g} s mean think time; {duration:g} s of arrivals, seed {SEED}, `--hold none`.",
        f"Load: sessions in flight × their peak prompt ({base.prompt_tokens(base.turns):,} tokens) = 0.5×, 1×, 2× "
        "the GPU KV tokens. Simulated at 1/" f"{scale} scale (GPU and host blocks, session rate and corpus ÷ {scale}; "
        "see the script's docstring). Recomputed = prompt tokens not served from GPU or host cache / prompt tokens; "
        "cold-start misses included. Answers count as new prompt tokens in the next turn (the model caches prompts only).",
        "",
        "| load | sessions/s (req/s) at full scale | requests simulated | GPU-only LRU | TensorRT-LLM defaults + host | "
        "kvgate classes + host | adaptive + host | Belady (GPU + host) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, pressure, rate, req_rate, n, rec, host in rows:
        lines.append(
            f"| {label} ({pressure:g}×) | {rate:.2f} ({req_rate:.1f}) | {n:,} | {pct(rec['lru'])} | {pct(rec['trtllm-default'])} "
            f"| {pct(rec['class'])} | {pct(rec['adaptive'])} | {pct(rec['belady'])} |"
        )
    lines += [
        "",
        "Share of prompt tokens served from the host tier: "
        + "; ".join(f"{label}: " + ", ".join(f"{n} {pct(host[n])}" for n in POLICIES if n != "lru")
                    for label, _p, _r, _q, _n, _rec, host in rows) + ".",
        "",
        f"Read as 256 GiB *per rank* (TensorRT-LLM's unit for `host_cache_size`; 2 TiB per node): {big_host:,} host blocks.",
        "",
        "| load | TensorRT-LLM defaults + host | kvgate classes + host | adaptive + host | Belady (GPU + host) | host share (defaults) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, pressure, rec, host in big_rows:
        lines.append(f"| {label} ({pressure:g}×) | {pct(rec['trtllm-default'])} | {pct(rec['class'])} | "
                     f"{pct(rec['adaptive'])} | {pct(rec['belady'])} | {pct(host['trtllm-default'])} |")
    light, heavy = raw["light"]["recompute"], raw["heavy"]["recompute"]
    big_heavy = raw["heavy"]["big_host"]["recompute"]
    gap = 100 * (heavy["class"] - heavy["trtllm-default"])
    classes = ("match the defaults" if abs(gap) < 1.0
               else f"are {abs(gap):.1f} points {'worse' if gap > 0 else 'better'} than the defaults")
    medium_lru = raw["medium"]["recompute"]["lru"]
    if medium_lru <= 0.38 <= heavy["lru"]:
        versus_vllm = "their vLLM figure (38 %) falls between our GPU-only LRU at medium and at heavy load"
    elif heavy["lru"] < 0.38:
        versus_vllm = "our GPU-only LRU stays below their vLLM figure (38 %) even at 2× load"
    else:
        versus_vllm = "our GPU-only LRU exceeds their vLLM figure (38 %) already at medium load"
    lines += [
        "",
        f"Reading: at light load the sessions fit in GPU memory and every policy sits near the floor "
        f"(Belady {pct(light['belady'])}): each document's first use, each turn's new user message, and the "
        f"previous answer. At 2× load GPU-only LRU evicts histories between turns ({pct(heavy['lru'])} recomputed); "
        f"the 32 GiB-per-rank host tier brings it to {pct(heavy['trtllm-default'])}, a 2 TiB one to "
        f"{pct(big_heavy['trtllm-default'])} (Belady: {pct(heavy['belady'])} and {pct(big_heavy['belady'])}). Classes {classes} here: "
        "one tenant, one class, and retrieved documents and conversation history share the `context` segment, so a "
        "priority cannot tell a popular document from one session's history; classes pay off between tenants (noisy "
        f"neighbour above). Against the design notes: {versus_vllm}; their LMCache rows add CPU + NVMe tiers far larger "
        "than this host tier. The floor itself rests on what the design notes do not state (corpus size and skew, "
        "answer length, answers counted as new prompt tokens), so compare columns within a table more than across tables.",
        "",
        "The design notes' table (72B FP8 on 8 × H200, measured on GPUs, other engines):",
        "",
        "| setup | prefill recomputed |",
        "|---|---:|",
        *(f"| {name} | {value} |" for name, value in DESIGN_NOTES),
        "",
        f"{replays} replays of {total_requests:,} requests + Belady in {seconds:.0f} s ({machine()}, shared).",
    ]
    return "\n".join(lines), raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--scale", type=int, default=16, help="simulate 1/SCALE of the replica (default 16)")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of session arrivals (default 1800)")
    args = parser.parse_args()
    if args.scale < 1 or args.duration <= 0:
        parser.error("--scale must be >= 1 and --duration > 0")
    section, raw = run(args.scale, args.duration)
    print(section)
    print(json.dumps(raw, indent=2), file=sys.stderr)
    if not args.no_write:
        write_section("rag_chat", section)


if __name__ == "__main__":
    main()
