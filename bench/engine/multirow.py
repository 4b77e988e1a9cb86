"""Multi-row GEMM choice of the ``q4`` reference engine, side by side on this CPU.

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine/multirow.py [--rounds 3] [--no-write]

``q4`` runs steps of up to 4 rows on the GGUF's 4-bit codes and larger steps (prefill,
batched decode, the LM head for several rows) on a second copy of each matrix
(``engines.reference.linear.multi_row_linear``). This bench loads the model once and runs
the same forward steps with two copies of those matrices, alternating in one window:

* ``shipped`` — what ``multi_row_linear`` picks on this CPU (packed bf16 with native bf16,
  packed fp32 elsewhere);
* ``bf16 dense`` — the previous fallback on CPUs without native bf16: plain bf16 tensors
  (torch emulates bf16 GEMMs on, e.g., AVX2-only CPUs).

Figures: a 512-token prefill step and an 8-sequence decode step (300 cached tokens each),
FP8 E4M3 KV, 1 torch thread, median of ``--rounds``; and the ratio old / shipped. Writes the
``<!-- bench:multirow -->`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.report import machine, publish, seed_line  # noqa: E402
from engines.reference.kv_cache import KvDtype, KvGeometry, PagedKvCache  # noqa: E402
from engines.reference.linear import DenseLinear, PackedLinear, RowAdaptiveLinear, native_bf16  # noqa: E402
from engines.reference.loader import load_model  # noqa: E402
from engines.reference.model import DecodeGroup, LlamaModel, PrefillSpan, StepBatch  # noqa: E402

DECODE_ROWS, DECODE_CONTEXT, PREFILL_TOKENS = 8, 300, 512
SEED = 0  # the token ids of the measured steps


def with_multi(weights, make):  # noqa: ANN001, ANN201
    """A copy of ``weights`` whose row-adaptive linears use ``make(dense fp32 matrix)`` for many rows."""
    def swap(linear):  # noqa: ANN001, ANN202
        return replace(linear, multi=make(linear.multi.dense())) if isinstance(linear, RowAdaptiveLinear) else linear

    layers = [replace(layer, wqkv=swap(layer.wqkv), wo=swap(layer.wo), w_gate_up=swap(layer.w_gate_up),
                      w_down=swap(layer.w_down)) for layer in weights.layers]
    return replace(weights, layers=layers, lm_head=swap(weights.lm_head))


def describe(linear) -> str:  # noqa: ANN001
    if isinstance(linear, PackedLinear):
        return f"packed {str(linear.dtype).removeprefix('torch.')}"
    return f"dense {str(linear.weight.dtype).removeprefix('torch.')}"


def steps(model: LlamaModel):  # noqa: ANN201
    cfg = model.config
    geometry = KvGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16)
    blocks = (DECODE_ROWS * DECODE_CONTEXT + PREFILL_TOKENS) // 16 + 8
    cache = PagedKvCache(geometry, KvDtype.FP8_E4M3, primary_blocks=blocks, compute_dtype=model.dtype)
    gen = torch.Generator().manual_seed(SEED)
    slots = torch.arange(PREFILL_TOKENS)
    prefill = StepBatch(
        token_ids=torch.randint(0, cfg.vocab_size, (PREFILL_TOKENS,), generator=gen), positions=slots.clone(),
        write_slots=slots, prefills=[PrefillSpan(0, PREFILL_TOKENS, slots, 0)],
        logit_rows=torch.tensor([PREFILL_TOKENS - 1]),
    )
    ctx = torch.arange(DECODE_ROWS * DECODE_CONTEXT).view(DECODE_ROWS, DECODE_CONTEXT) + PREFILL_TOKENS
    decode = StepBatch(
        token_ids=torch.randint(0, cfg.vocab_size, (DECODE_ROWS,), generator=gen),
        positions=torch.full((DECODE_ROWS,), DECODE_CONTEXT - 1), write_slots=ctx[:, -1].contiguous(),
        decode=DecodeGroup(0, ctx, torch.ones(DECODE_ROWS, 1, 1, DECODE_CONTEXT, dtype=torch.bool)),
        logit_rows=torch.arange(DECODE_ROWS),
    )
    return cache, prefill, decode


def timed(model: LlamaModel, cache: PagedKvCache, batch: StepBatch) -> float:
    started = time.perf_counter()
    model.forward(batch, cache)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    print("loading SmolLM2 (q4) ...", flush=True)
    bundle = load_model(weight_format="q4")
    shipped = bundle.model.weights
    variants = {
        "shipped": LlamaModel(shipped),
        "bf16 dense": LlamaModel(with_multi(shipped, lambda w: DenseLinear(w.to(torch.bfloat16).contiguous()))),
    }
    kernel = describe(shipped.layers[0].wqkv.multi)
    cache, prefill, decode = steps(variants["shipped"])
    for model in variants.values():  # warm-up: first calls allocate and pick kernels
        model.forward(prefill, cache)
        model.forward(decode, cache)
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in variants}
    for r in range(args.rounds):
        for name, model in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            times[name]["prefill"].append(timed(model, cache, prefill))
            times[name]["decode"].append(timed(model, cache, decode))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} prefill {t['prefill'][-1]:.2f} s decode {1000 * t['decode'][-1]:.0f} ms" for n, t in times.items()),
            flush=True)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    lines = [
        "## Multi-row GEMMs of the `q4` engine on this CPU (`bench/engine/multirow.py`)",
        "",
        seed_line(SEED, "`torch.Generator().manual_seed`: the token ids of the measured steps"),
        "",
        f"Machine: {machine()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16: "
        f"{'yes' if native_bf16() else 'no'}; shipped multi-row kernel: {kernel}. One model, two copies of the "
        f"multi-row matrices, alternating in one window, 1 thread, FP8 E4M3 KV, median of {args.rounds}.",
        "",
        f"| multi-row matrices | prefill {PREFILL_TOKENS} tokens: s (tok/s) | decode step, {DECODE_ROWS} seqs × "
        f"{DECODE_CONTEXT} ctx: ms (tok/s) |",
        "|---|---:|---:|",
    ]
    for name, m in med.items():
        label = f"{name} ({kernel})" if name == "shipped" else name
        lines.append(f"| {label} | {m['prefill']:.2f} ({PREFILL_TOKENS / m['prefill']:.0f}) | "
                     f"{1000 * m['decode']:.0f} ({DECODE_ROWS / m['decode']:.1f}) |")
    old, new = med["bf16 dense"], med["shipped"]
    lines += [
        "",
        f"bf16 dense / shipped: prefill {old['prefill'] / new['prefill']:.2f}×, decode step "
        f"{old['decode'] / new['decode']:.2f}× the time.",
    ]
    body = "\n".join(lines)
    publish("multirow", body, write=not args.no_write)


if __name__ == "__main__":
    main()
