"""`kvgate analyze TRACE`: measure reuse before sizing a host tier.

Examples::

    kvgate analyze ../shared/traces/mooncake_synthetic_trace.jsonl --kv-bytes-per-token 65536
    kvgate analyze capture.jsonl --model llama-3.1-8b --kv-dtype fp8 --plots report/ --json > report.json

Answers, per tenant and per segment: the most shared prefixes (tokens saved), the
reuse-gap distribution, the KV bytes reuse would move over the host link per second
against a budget, the share of one-shot blocks; recommends a host tier size (knee of the
simulated hit-rate curve) and per-segment retention durations (reuse-gap percentile), and
says what retention adds over LRU at the curve's GPU capacity from replays of the candidate
policies (the age-based figure beside them, a bound or an estimate).
The analytics live in ``server/analysis/`` (DuckDB); this module reads options and draws.
A bad trace or option exits 2 with a message naming the line or flag.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

import typer


class OptionError(ValueError):
    pass


def kv_bytes_from_model(model: str, kv_dtype: str) -> float:
    """KV bytes per token of a bundled model shape (``engines.capacity``, from ``kvgate plan``)."""
    try:
        from engines.capacity import kv_bytes_per_token, load_shape
    except ImportError:
        raise OptionError("--model needs the model shapes of `kvgate plan` (engines/capacity), not in this build; "
                          "pass --kv-bytes-per-token instead") from None
    try:
        return float(kv_bytes_per_token(load_shape(model), kv_dtype))
    except ValueError as exc:
        raise OptionError(f"--model {model!r}: {exc}") from None


def _multiples(text: str) -> tuple[float, ...]:
    try:
        values = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise OptionError(f"--host-multiples {text!r} must be comma-separated numbers like 0,1,2,4") from None
    if len(values) < 2 or any(not math.isfinite(v) or v < 0 for v in values):
        raise OptionError("--host-multiples needs at least two numbers >= 0")
    return values


def _check_gpu(text: str) -> None:
    """``--gpu`` read for its syntax before the DuckDB pass (its value needs the trace's distinct
    blocks, known only after): a block count >= 1, or a share in (0, 1600] % (past 16 x the
    distinct blocks the simulator refuses it anyway, and 1e308% would overflow the count)."""
    from retention.simulation.capacity import MAX_DISTINCT_MULTIPLE

    raw = text.strip()
    limit = 100 * MAX_DISTINCT_MULTIPLE
    share = 0.0  # a block count: no share to bound
    try:
        if raw.endswith("%"):
            share = float(raw[:-1])
            if not math.isfinite(share) or share <= 0:
                raise ValueError
        elif int(raw) < 1:
            raise ValueError
    except ValueError:
        raise OptionError(f"--gpu {text!r} must be a block count >= 1 or a percentage like 2%") from None
    if share > limit:
        raise OptionError(f"--gpu {text!r}: a share above {limit}% ({MAX_DISTINCT_MULTIPLE} x the trace's distinct "
                          "blocks) holds everything many times over")


_MEMORY = re.compile(r"\s*(\d+\.?\d*|\.\d+)(e[+-]?\d+)?\s*[a-z%]+\s*", re.IGNORECASE)


def _check_memory_limit(text: str) -> None:
    """``--memory-limit``: a positive amount with a unit DuckDB reads (``1GB``, ``512MiB``, ``50%``).

    DuckDB itself takes ``-5GB`` for no limit at all and ``0GB`` fails later: both are refused here,
    and the unit is checked by DuckDB (a throwaway in-memory connection) before the trace is read."""
    import duckdb

    match = _MEMORY.fullmatch(text)
    if match is None or not 0 < float(match.group(1) + (match.group(2) or "")) < math.inf:
        raise OptionError(f"--memory-limit {text!r} must be a positive amount with a unit, like 1GB, 512MiB or 50%")
    try:
        duckdb.connect(":memory:", config={"memory_limit": text}).close()
    except duckdb.Error as exc:
        reason = str(exc).split("\n")[0].split(": ", 1)[-1]
        raise OptionError(f"--memory-limit {text!r}: {reason}") from None


def _check_plots_dir(plots: Path) -> None:
    """Refuse a --plots path the plots cannot be written to, before the analysis runs."""
    from server.cli.options import output_dir_problem

    problem = output_dir_problem(plots)
    if problem:
        raise OptionError(f"--plots {plots} {problem}")


def register(app: typer.Typer) -> None:
    """Attach ``kvgate analyze`` to the root CLI."""

    @app.command("analyze")
    def analyze(
        trace: Annotated[Path, typer.Argument(help="Mooncake-format JSONL trace, plain or gzip (a kvgate capture or export too)")],
        block_size: Annotated[int | None, typer.Option("--block-size", help="tokens per hash id (default: the lines' "
                              "block_size, else 512)")] = None,
        kv_bytes_per_token: Annotated[float | None, typer.Option("--kv-bytes-per-token", help="KV bytes per token "
                                      "(all layers: 2 x layers x KV heads x head dim x dtype bytes; Llama-3.1-8B: 65536 in FP8)")] = None,
        model: Annotated[str | None, typer.Option("--model", help="bundled model shape for the KV bytes per token "
                         "(as kvgate plan), instead of --kv-bytes-per-token")] = None,
        kv_dtype: Annotated[str | None, typer.Option("--kv-dtype", help="KV dtype with --model: fp8 | fp16 | bf16 | "
                            "fp32 (default fp8)")] = None,
        link_gb_s: Annotated[float, typer.Option("--host-link-gb-s", help="host-link budget, GB/s per GPU")] = 25.0,
        gpu: Annotated[str, typer.Option("--gpu", help="GPU capacity for the host-tier curve: blocks or % of distinct")] = "2%",
        host_multiples: Annotated[str, typer.Option("--host-multiples", help="host sizes as multiples of the GPU "
                                  "capacity")] = "0,0.5,1,2,4,8,16,32",
        curve_requests: Annotated[int, typer.Option("--curve-requests", help="replay the first N lines for the "
                                  "curve (0 = all)")] = 20_000,
        no_curve: Annotated[bool, typer.Option("--no-curve", help="skip the simulated host-tier curve")] = False,
        percentile: Annotated[float, typer.Option("--duration-percentile", help="reuse-gap percentile a duration "
                              "covers")] = 90.0,
        top: Annotated[int, typer.Option("--top", help="shared prefixes listed per tenant")] = 10,
        memory_limit: Annotated[str, typer.Option("--memory-limit", help="DuckDB memory limit; beyond it, it "
                                "spills to a temporary directory")] = "1GB",
        as_json: Annotated[bool, typer.Option("--json", help="print the full report as JSON")] = False,
        plots: Annotated[Path | None, typer.Option("--plots", help="directory for PNG plots")] = None,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="progress on stderr")] = True,
    ) -> None:
        """Reuse report of a trace: shared prefixes, reuse gaps, host-link load, one-shot blocks, sizing."""
        from server.analysis.report import AnalyzeOptions, build_report
        from server.analysis.reuse import AnalyzeError

        try:
            if kv_bytes_per_token is not None and model is not None:
                raise OptionError("give --kv-bytes-per-token or --model, not both")
            if kv_bytes_per_token is not None and (not math.isfinite(kv_bytes_per_token) or kv_bytes_per_token <= 0):
                raise OptionError("--kv-bytes-per-token must be > 0")
            if kv_dtype is not None and model is None:  # documented as "with --model": alone it would change nothing
                raise OptionError(f"--kv-dtype {kv_dtype} applies only with --model (it picks the model's KV bytes "
                                  "per token); with --kv-bytes-per-token give the bytes of your dtype")
            kvb = kv_bytes_from_model(model, kv_dtype or "fp8") if model is not None else kv_bytes_per_token
            if not math.isfinite(link_gb_s * 1e9) or link_gb_s <= 0:
                raise OptionError("--host-link-gb-s must be > 0 and a finite number of bytes per second")
            if not 0 < percentile <= 100:
                raise OptionError("--duration-percentile must be in (0, 100]")
            if top < 1 or curve_requests < 0 or (block_size is not None and block_size < 1):
                raise OptionError("--top and --block-size must be >= 1, --curve-requests >= 0")
            multiples = _multiples(host_multiples)
            if not no_curve:
                _check_gpu(gpu)
            _check_memory_limit(memory_limit)
            if plots is not None:
                _check_plots_dir(plots)
            options = AnalyzeOptions(
                block_size=block_size, kv_bytes_per_token=kvb, link_bytes_per_s=link_gb_s * 1e9, top=top, gpu=gpu,
                host_multiples=multiples, curve_requests=curve_requests or None, curve=not no_curve,
                duration_percentile=percentile, memory_limit=memory_limit,
            )
            if progress:
                report = _with_progress(trace, options)
            else:
                report = build_report(trace, options)
            overflow = _non_finite(report)
            if overflow is not None:
                raise OptionError(f"{overflow} overflows (not a finite number)"
                                  + (f": --kv-bytes-per-token {kvb:g} is too large" if kvb is not None else ""))
        except (OptionError, AnalyzeError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        written = []
        if plots is not None:
            from server.analysis.plots import write_all

            written = write_all(report, plots)
        if as_json:
            typer.echo(json.dumps(report, indent=2, default=float, allow_nan=False))  # JSON has no Infinity
            return
        _print_report(report)
        for path in written:
            typer.echo(f"plot written to {path}")


def _non_finite(value: Any, where: str = "") -> str | None:
    """The key path of the first infinite or NaN number in the report (products of huge
    options overflow floats), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "a figure"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def _with_progress(trace: Path, options: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from server.analysis.report import build_report

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("analysing", total=None)
        return build_report(
            trace, options,
            stage=lambda text: bar.update(task, description=text),
            advance=lambda n: bar.advance(task, n),
            set_total=lambda n: bar.update(task, total=n, completed=0),
        )


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:,.1f} s"


def _bytes(x: float) -> str:
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if x >= scale:
            return f"{x / scale:,.2f} {name}"
    return f"{x:,.0f} B"


def _rate(x: float | None, unit: str) -> str:
    if x is None:
        return ""
    if unit == "bytes":
        return _bytes(x) + "/s"
    return f"{x:,.0f} tok/s"


def _print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from server.analysis.recommend import points_between

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    ov = report["overview"]
    console.print(f"{ov['requests']:,} requests, {ov['tenants']} tenant(s), {ov['prompt_tokens']:,} prompt tokens, "
                  f"{ov['distinct_blocks']:,} distinct blocks of {ov['block_size']} tokens over {ov['duration_s']:,.1f} s")

    # collapse the CUBE's duplicate rows when there is one tenant or one segment
    tenants = {r["tenant"] for r in report["reuse"] if r["tenant"] != "*"}
    segments = {r["segment"] for r in report["reuse"] if r["segment"] != "*"}

    def keep(r: dict[str, Any]) -> bool:
        return not ((r["tenant"] != "*" and len(tenants) == 1) or (r["segment"] != "*" and len(segments) == 1))

    table = Table(title="reuse and one-shot blocks (unbounded cache)")
    for col in ("tenant", "segment", "tokens", "reused tokens", "reuse", "distinct blocks", "one-shot blocks",
                "one-shot tokens"):
        table.add_column(col, justify="left" if col in ("tenant", "segment") else "right")
    for r in filter(keep, report["reuse"]):
        table.add_row(r["tenant"], r["segment"], f"{r['tokens']:,}", f"{r['reused_tokens']:,}", _pct(r["reuse_share"]),
                      f"{r['distinct_blocks']:,}", _pct(r["one_shot_share"]), _pct(r["one_shot_token_share"]))
    console.print(table)

    table = Table(title="most shared prefixes (tokens saved)")
    for col in ("tenant", "rank", "prefix end id", "blocks", "ends in", "requests", "tokens saved"):
        table.add_column(col, justify="left" if col in ("tenant", "ends in") else "right")
    for r in report["top_prefixes"]:
        table.add_row(r["tenant"], str(r["rank"]), str(r["end_id"]), f"{r['blocks']:,}", r["ends_in"],
                      f"{r['requests']:,}", f"{r['tokens_saved']:,}")
    console.print(table)

    table = Table(title="reuse gaps (time since the block's previous use)")
    for col in ("tenant", "segment", "reuses", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="left" if col in ("tenant", "segment") else "right")
    for r in filter(keep, report["reuse_gaps"]):
        table.add_row(r["tenant"], r["segment"], f"{r['reuses']:,}", _secs(r["p50_s"]), _secs(r["p90_s"]),
                      _secs(r["p99_s"]), _secs(r["max_s"]))
    console.print(table)

    tr = report["transfer"]
    unit = "bytes" if tr["kv_bytes_per_token"] is not None else "tokens"
    table = Table(title=f"host-link load if reuse came from host (budget {tr['link_bytes_per_s'] / 1e9:g} GB/s"
                        + (f", {tr['kv_bytes_per_token']:,.0f} KV bytes/token)" if unit == "bytes" else
                           "; pass --kv-bytes-per-token or --model for bytes)"))
    for col in ("direction", "mean", "p99 second", "max second"):
        table.add_column(col, justify="left" if col == "direction" else "right")
    for name, key in (("host → GPU (reused)", "onboard"), ("GPU → host (new)", "offload")):
        table.add_row(name, _rate(tr[f"{key}_mean_{unit}_per_s"], unit), _rate(tr[f"{key}_p99_{unit}_per_s"], unit),
                      _rate(tr[f"{key}_max_{unit}_per_s"], unit))
    console.print(table)
    if unit == "bytes":
        console.print(f"seconds over the budget (both directions): {tr['seconds_over_budget']:,} of {tr['seconds']:,.0f}")

    if report["observed"]:
        table = Table(title="observed by the engine (live capture)")
        for col in ("tenant", "requests", "GPU-cached", "host-cached", "TTFT p50", "TTFT p99"):
            table.add_column(col, justify="left" if col == "tenant" else "right")
        for r in report["observed"]:
            table.add_row(r["tenant"], f"{r['requests']:,}", _pct(r["gpu_hit_share"]), _pct(r["host_hit_share"]),
                          "" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:.1f} ms",
                          "" if r["ttft_p99_ms"] is None else f"{r['ttft_p99_ms']:.1f} ms")
        console.print(table)

    rec = report["recommendations"]
    curve = report.get("host_curve")
    if curve:
        table = Table(title=f"host-tier curve: GPU {curve['gpu_blocks']:,} blocks, {curve['requests_replayed']:,} "
                            f"requests replayed ({curve['policy']})")
        for col in ("host blocks", "hit rate", "GPU", "host", ""):
            table.add_column(col, justify="right")
        for i, p in enumerate(curve["points"]):
            table.add_row(f"{p['host_blocks']:,}", _pct(p["hit_rate"]), _pct(p["gpu_hit_rate"]), _pct(p["host_hit_rate"]),
                          "← knee" if i == curve["knee_index"] else "")
        console.print(table)
        host = rec["host_tier"]
        tokens = host["host_blocks"] * host["block_size"]
        size = f"{tokens:,} tokens" + (f", {_bytes(host['host_bytes'])} of KV" if "host_bytes" in host else "")
        knee_rate, base_rate = curve["points"][curve["knee_index"]]["hit_rate"], curve["points"][0]["hit_rate"]
        console.print(f"recommended host tier: {host['host_blocks']:,} blocks of {host['block_size']:,} tokens "
                      f"({size}), "
                      f"{points_between(base_rate, knee_rate):+.1f} points of hit rate over GPU only"
                      + ("" if host["saturated"] else " — the curve is still rising at the largest size measured: "
                         "this is a lower bound, try larger --host-multiples"))
        ret = curve["retention"]
        table = Table(title=f"retention headroom: GPU {ret['gpu_blocks']:,} blocks, GPU only")
        replayed = {name: rate for name, rate in ret["replayed"].items() if name != "trtllm-default"}
        columns = ["LRU (trtllm-default)", *(f"{name} (replayed)" for name in replayed),
                   f"age-based ({ret['age_based_kind']})", "Belady (knows the future)"]
        for col in columns:
            table.add_column(col, justify="right")
        table.add_row(_pct(ret["lru"]), *(_pct(rate) for rate in replayed.values()), _pct(ret["age_based"]),
                      _pct(ret["belady"]))
        console.print(table)
        console.print(ret["verdict"])
    table = Table(title="recommended retention durations (reuse-gap percentile)")
    for col in ("tenant", "segment", "reuses", "percentile", "duration_ms"):
        table.add_column(col, justify="left" if col in ("tenant", "segment") else "right")
    for r in filter(keep, rec["durations"]):
        table.add_row(r["tenant"], r["segment"], f"{r['reuses']:,}", f"p{r['percentile']:g}",
                      f"{r['duration_ms']:,}" if r["duration_ms"] is not None else r["reason"])
    console.print(table)
