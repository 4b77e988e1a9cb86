"""`kvgate plan MODEL`: size a pool from a model's config.json and the hardware.

Examples::

    kvgate plan llama-3.1-70b --gpu h200 --tp 8 --host-memory 256GiB --context 8K
    kvgate plan ./DeepSeek-V3/config.json --gpu h200 --tp 8 --weights fp8 --json
    kvgate plan qwen2.5-72b --gpu h200 --gpus 8 --tp 8 --host-blocks 500000
    kvgate plan llama-3.1-70b --gpu h100 --tp 8 --context 128K --sequences 256
    kvgate plan --spec llama-3.1-70b-instruct-fp8-tp8 --gpu h200
    kvgate plan --list

MODEL is a bundled shape name or a path to a Hugging Face ``config.json``. ``--spec`` takes
an engine spec (bundled name or YAML path) and reads from it what it fixes: TP/PP, tokens per
block, KV and weight dtypes, ``free_gpu_memory_fraction`` and ``host_cache_size`` (per rank), and
the model (its ``hf_id``, when a bundled shape has it); options given explicitly win. What the spec
leaves unreproducible (``engines.spec.spec_warnings``: an ``hf_id`` without a pinned commit) is printed
as ``note:`` lines and listed in the JSON's ``spec_warnings``; it does not change the plan. The arithmetic
lives in ``engines/capacity`` (pure); this module parses options and draws the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated

import typer

from engines.capacity.hardware import GIB

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class CliError(ValueError):
    pass


def parse_bytes(text: str, option: str) -> int:
    """``"256GiB"`` → 274877906944; ``"80GB"`` → 80e9; ``"1024"`` → 1024 bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise CliError(f"{option} {text!r} must be a size like 256GiB, 80GB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_tokens(text: str, option: str) -> int:
    """``"128K"`` → 131072 (K = 1024 tokens, as context lengths are quoted); ``"8192"`` → 8192."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", text)
    if match is None or int(match.group(1)) < 1:
        raise CliError(f"{option} {text!r} must be a token count like 8192 or 128K")
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GIB:,.2f} GiB"


def register(app: typer.Typer) -> None:
    """Attach ``kvgate plan`` to the root CLI."""

    @app.command("plan")
    def plan_command(
        model: Annotated[str | None, typer.Argument(help="bundled shape name or path to a config.json")] = None,
        gpu: Annotated[str, typer.Option("--gpu", help="GPU type: h100-80gb, h200-141gb, a100-80gb, l40s-48gb, b200-180gb")] = "h100-80gb",
        gpu_memory_gib: Annotated[float | None, typer.Option("--gpu-memory-gib", help="override the GPU's memory (GiB)")] = None,
        gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs in the pool (default tp × pp: one replica)")] = None,
        spec: Annotated[str | None, typer.Option("--spec", help="engine spec (bundled name or YAML): TP, block size, dtypes, fraction, host_cache_size, model")] = None,
        tp: Annotated[int | None, typer.Option("--tp", help="tensor parallel size [1]")] = None,
        pp: Annotated[int | None, typer.Option("--pp", help="pipeline parallel size [1]")] = None,
        kv_dtype: Annotated[str | None, typer.Option("--kv-dtype", help="fp8 | fp16 | bf16 | fp32 \\[fp8]")] = None,
        weights: Annotated[str | None, typer.Option("--weights", help="weight dtype of linear layers: bf16 | fp16 | fp8 "
                           "\\[fp8 with FP8 KV, the only pair a spec takes; else bf16]")] = None,
        tokens_per_block: Annotated[int | None, typer.Option("--tokens-per-block", help="KV block size (fixed at engine build) [32]")] = None,
        fraction: Annotated[float | None, typer.Option("--free-gpu-memory-fraction", help="TensorRT-LLM KvCacheConfig fraction of free memory for KV [0.9]")] = None,
        reserve_gib: Annotated[float, typer.Option("--reserve-gib", help="per-rank memory besides weights and KV (activations, CUDA context, NCCL): an estimate, measure it")] = 4.0,
        host_cache_size: Annotated[str | None, typer.Option("--host-cache-size", help="host KV bytes PER RANK (TensorRT-LLM's unit), e.g. 32GiB")] = None,
        host_memory: Annotated[str | None, typer.Option("--host-memory", help="host KV bytes PER REPLICA, split over its ranks, e.g. 256GiB")] = None,
        host_blocks: Annotated[int | None, typer.Option("--host-blocks", help="reverse: host blocks wanted → host_cache_size")] = None,
        context: Annotated[str, typer.Option("--context", help="context length per sequence, e.g. 8192 or 128K")] = "8192",
        sequences: Annotated[int | None, typer.Option("--sequences", help="also report the KV that N sequences at --context need")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
        list_known: Annotated[bool, typer.Option("--list", help="list bundled model shapes and GPU types")] = False,
    ) -> None:
        """KV bytes per token, weights, primary/host blocks per replica, concurrency, and the pool/spec values."""
        from engines.capacity.arithmetic import PlanError, PlanInputs, host_cache_size_for_blocks, plan
        from engines.capacity.hardware import Hardware, HardwareError, bundled_gpus, load_gpu
        from engines.capacity.shapes import ShapeError, bundled_shape_names, load_shape
        from engines.capacity.spec_choice import no_spec_reason, spec_choice
        from engines.spec import SpecError, load_spec, spec_warnings

        if list_known:
            typer.echo("model shapes: " + ", ".join(bundled_shape_names()))
            typer.echo("GPU types:    " + ", ".join(f"{k} ({g.memory_bytes / GIB:.1f} GiB)" for k, g in bundled_gpus().items()))
            return
        try:
            if sum(x is not None for x in (host_cache_size, host_memory, host_blocks)) > 1:
                raise CliError("give at most one of --host-cache-size, --host-memory, --host-blocks")
            if not (math.isfinite(reserve_gib) and reserve_gib >= 0 and math.isfinite(reserve_gib * GIB)):
                raise CliError("--reserve-gib must be a finite number of GiB >= 0")
            # "weights" None: they follow the KV dtype (below), unless a spec fixes them.
            defaults = {"tp": 1, "pp": 1, "kv_dtype": "fp8", "weights": None, "tokens_per_block": 32, "fraction": 0.9,
                        "host_cache_size": 0, "model": None}
            warnings: list[str] = []
            if spec is not None:
                defaults.update(spec_defaults(spec))
                warnings = spec_warnings(load_spec(spec))
            model = model or defaults["model"]
            if model is None:
                raise CliError("give a MODEL (bundled name or config.json path), or --list"
                               + (f"; no bundled shape has the spec's model {spec}" if spec else ""))
            # `is None`, not `or`: an explicit 0 must be refused below, not read as "unset".
            tp = defaults["tp"] if tp is None else tp
            pp = defaults["pp"] if pp is None else pp
            kv_dtype = kv_dtype or defaults["kv_dtype"]
            # FP8 KV keeps block reuse only with FP8 weights (spec rule fp8-kv-needs-fp8-weights), so the
            # defaults plan that valid pair; another KV dtype is no kvgate spec anyway and keeps bf16 weights.
            weights = weights or defaults["weights"] or ("fp8" if kv_dtype == "fp8" else "bf16")
            tokens_per_block = defaults["tokens_per_block"] if tokens_per_block is None else tokens_per_block
            fraction = fraction if fraction is not None else defaults["fraction"]
            shape = load_shape(model)
            gpu_type = load_gpu(gpu, memory_gib=gpu_memory_gib)
            world = tp * pp
            per_rank_host = defaults["host_cache_size"]
            if host_cache_size is not None:
                per_rank_host = parse_bytes(host_cache_size, "--host-cache-size")
            elif host_memory is not None:
                per_rank_host = parse_bytes(host_memory, "--host-memory") // max(1, world)
            inputs = PlanInputs(kv_dtype=kv_dtype, weight_dtype=weights, tokens_per_block=tokens_per_block,
                                free_gpu_memory_fraction=fraction, runtime_reserve_bytes=int(reserve_gib * GIB),
                                context_length=parse_tokens(context, "--context"), sequences=sequences)
            def sized(plan_inputs: PlanInputs):  # noqa: ANN202 - CapacityPlan
                planned = plan(shape, Hardware(gpu_type, world if gpus is None else gpus, tp, pp, per_rank_host), plan_inputs)
                if host_blocks is not None:
                    size = host_cache_size_for_blocks(host_blocks, planned.block_bytes_per_rank)
                    planned = plan(shape, Hardware(gpu_type, world if gpus is None else gpus, tp, pp, size), plan_inputs)
                return planned

            result = sized(inputs)
            # The spec values printed must validate (engines/spec.py): plan the nearest valid
            # dtypes when the user's cannot be a kvgate TensorRT-LLM spec, and say why.
            choice = spec_choice(kv_dtype, weights, gpu_type)
            valid = None
            if choice is not None:
                valid = result if choice.reason is None else sized(
                    dataclasses.replace(inputs, kv_dtype=choice.kv_dtype, weight_dtype=choice.weight_dtype))
        except (CliError, ShapeError, HardwareError, PlanError, SpecError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            doc = result.to_dict()
            # registration + spec always describe one deployable engine (None when none is valid)
            doc["registration"] = valid.registration() if valid is not None else None
            doc["spec"] = valid.spec_values() if valid is not None else None
            doc["spec_choice"] = {
                "kv_dtype": choice.kv_dtype if choice else None, "weights": choice.weight_dtype if choice else None,
                "changed": bool(choice and choice.reason) or choice is None,
                "reason": (choice.reason if choice else no_spec_reason(gpu_type)),
            }
            doc["spec_warnings"] = warnings
            typer.echo(json.dumps(doc, indent=2))
        else:
            print_plan(result, valid, choice, no_spec_reason(gpu_type), spec_notes=warnings)


def spec_defaults(ref: str) -> dict[str, object]:
    """What an engine spec fixes, in ``kvgate plan`` terms. ``host_cache_size`` is per rank:
    TensorRT-LLM gives every rank's KV cache manager that many bytes (kvCacheManager.cpp
    ``calculateFreeMemBytes``)."""
    from engines.capacity.shapes import bundled_shape_for_hf_id
    from engines.spec import load_spec

    engine_spec = load_spec(ref)
    kv = engine_spec.quantization.kv_cache
    out: dict[str, object] = {
        "tp": engine_spec.build.tensor_parallel, "pp": engine_spec.build.pipeline_parallel,
        "kv_dtype": "fp8" if kv.startswith("fp8") else kv,
        "weights": "fp8" if engine_spec.quantization.weights == "fp8" else "bf16",
        "tokens_per_block": engine_spec.build.tokens_per_block,
        "fraction": engine_spec.kv_cache.free_gpu_memory_fraction,
        "host_cache_size": engine_spec.kv_cache.host_cache_size_per_rank,
        "model": bundled_shape_for_hf_id(engine_spec.model.hf_id) if engine_spec.model.hf_id else None,
    }
    return out


def print_plan(p, valid=None, choice=None, no_spec: str = "", spec_notes: list[str] | tuple[str, ...] = ()) -> None:  # noqa: ANN001 - CapacityPlan, SpecChoice
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    table = Table(title=f"{p.model} ({p.attention.upper()}) on {p.gpus} × {p.gpu}, TP {p.tensor_parallel} PP {p.pipeline_parallel}, "
                        f"{p.replicas} replica(s)", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("how", style="dim")
    world = p.tensor_parallel * p.pipeline_parallel
    rows = [
        ("parameters", f"{p.params / 1e9:,.2f} B", "config.json; MoE: all experts resident"),
        (f"weights ({p.weight_dtype})", _gib(p.weight_bytes), "linear layers at the weight dtype, the rest 16-bit"),
        ("weights per rank", _gib(p.weight_bytes_per_rank), f"÷ {world} ranks"),
        (f"KV bytes / token ({p.kv_dtype})", f"{p.kv_bytes_per_token:,}", "model, all layers, counted once"),
        ("KV bytes / token per rank", f"{p.kv_bytes_per_token_per_rank:,}", "one rank's layers and heads"),
        ("KV bytes / token per replica", f"{p.kv_bytes_per_token_per_replica:,}", "Σ over ranks (replicated KV counts again)"),
        ("block bytes per rank", f"{p.block_bytes_per_rank:,}", f"× {p.tokens_per_block} tokens per block"),
        ("GPU memory per rank", _gib(p.gpu_memory_bytes), ""),
        ("runtime reserve per rank", _gib(p.runtime_reserve_bytes), "estimate: activations, CUDA context, NCCL"),
        ("free per rank", _gib(p.free_bytes_per_rank), "memory − weights − reserve"),
        ("KV memory per rank", _gib(p.kv_bytes_per_rank), f"free × free_gpu_memory_fraction {p.free_gpu_memory_fraction}"),
        ("KV tokens per replica", f"{p.primary_tokens:,}", "KV memory per rank ÷ bytes/token per rank"),
        ("primary blocks per replica", f"{p.primary_blocks:,}", "ceil(tokens ÷ tokens_per_block), as TensorRT-LLM"),
        ("host_cache_size (per rank)", _gib(p.host_cache_size), f"{p.host_cache_size:,} bytes"),
        ("host memory per replica", _gib(p.host_bytes_per_replica), f"× {world} ranks"),
        ("secondary blocks per replica", f"{p.secondary_blocks:,}", "floor(host bytes ÷ block bytes), per rank"),
        (f"sequences at {p.context_length:,} tokens", f"{p.concurrent_sequences:,} per replica",
         f"{p.primary_blocks:,} ÷ {p.blocks_per_sequence:,} blocks per sequence"),
    ]
    if p.sequences is not None:
        rows.append((f"KV for {p.sequences:,} × {p.context_length:,} tokens", _gib(p.kv_bytes_for_sequences),
                     "model bytes/token × tokens"))
        rows.append(("  as HBM over all ranks", _gib(p.kv_hbm_bytes_for_sequences), "block-rounded, replicated KV included"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in p.notes:
        console.print(f"note: {note}")
    for note in spec_notes:  # plain echo: a long sentence with a spec field name, not wrapped
        typer.echo(f"note: spec: {note}")
    # Plain echo: these lines are meant to be copied, so no wrapping. They always describe an engine
    # spec that validates: the user's dtypes when they can, else the nearest valid ones.
    if valid is None:
        typer.echo(f"no engine spec: {no_spec}")
        return
    if choice is not None and choice.reason is not None:
        typer.echo(f"note: {choice.reason}.")
        typer.echo(f"nearest valid choice: {choice.flags} — {valid.primary_blocks:,} primary blocks per replica, "
                   f"{valid.concurrent_sequences:,} sequences at {valid.context_length:,} tokens")
    typer.echo("pool registration (admin API / registry.yaml): " + json.dumps(valid.registration()))
    typer.echo("spec values: " + json.dumps(valid.spec_values()))
