"""The ``kvgate analyze`` report: the four reuse questions plus recommendations, as one dict.

The dict is what ``--json`` prints and what the tables and plots are drawn from; every
number in it is defined in ``server/analysis/reuse.py`` and ``recommend.py``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from server.analysis import recommend, reuse


@dataclass(frozen=True, slots=True)
class AnalyzeOptions:
    block_size: int | None = None  # None: the lines' block_size field, else 512
    kv_bytes_per_token: float | None = None  # None: the transfer section reports tokens only
    link_bytes_per_s: float = 25e9
    top: int = 10
    gpu: str = "2%"  # GPU capacity of the host-tier curve: blocks or a share of distinct blocks
    host_multiples: tuple[float, ...] = recommend.DEFAULT_HOST_MULTIPLES
    curve_requests: int | None = 20_000  # None: replay the whole trace for the curve
    curve: bool = True
    duration_percentile: float = 90.0
    memory_limit: str = "1GB"  # DuckDB spills beyond it (to a temporary directory)
    family: str | None = None  # generated family of the trace, if known: the age-based figure is then a bound or not


Stage = Callable[[str], None]
Advance = Callable[[int], None]


def build_report(path: Path, options: AnalyzeOptions, *, stage: Stage | None = None, advance: Advance | None = None,
                 set_total: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Analyse ``path``; raises ``reuse.AnalyzeError`` for a bad trace (or bad options)."""
    def say(text: str) -> None:
        if stage is not None:
            stage(text)

    say("loading the trace")
    with tempfile.TemporaryDirectory(prefix="kvgate-analyze-") as spill:
        try:
            return _build(path, options, Path(spill), say, advance, set_total)
        except duckdb.OutOfMemoryException:
            raise reuse.AnalyzeError(f"DuckDB needed more than --memory-limit {options.memory_limit} for {path}; "
                                     "raise it (it spills to disk beyond the limit where it can)") from None


def _build(path: Path, options: AnalyzeOptions, spill: Path, say: Stage, advance: Advance | None,
           set_total: Callable[[int], None] | None) -> dict[str, Any]:
    tables = reuse.load_trace(path, block_size=options.block_size, memory_limit=options.memory_limit,
                              temp_directory=spill)
    say("reuse per tenant and segment")
    report: dict[str, Any] = {"trace": str(path), "overview": reuse.overview(tables)}
    report["reuse"] = reuse.reuse_by_group(tables)
    report["top_prefixes"] = reuse.top_prefixes(tables, top=options.top)
    say("reuse gaps")
    report["reuse_gaps"] = reuse.reuse_gaps(tables)
    say("KV transfer")
    kvb = options.kv_bytes_per_token
    report["transfer"] = reuse.transfer(tables, kv_bytes_per_token=kvb if kvb is not None else 1.0,
                                        link_bytes_per_s=options.link_bytes_per_s)
    if kvb is None:  # the same figures in tokens per second; bytes unknown
        tr = report["transfer"]
        report["transfer"] = {
            "kv_bytes_per_token": None, "link_bytes_per_s": options.link_bytes_per_s, "seconds": tr["seconds"],
            **{k.replace("bytes", "tokens"): v for k, v in tr.items()
               if k.startswith(("onboard", "offload", "observed"))},
            "timeline": [], "tenants": [{"tenant": r["tenant"], "onboard_mean_tokens_per_s": r["onboard_mean_bytes_per_s"],
                                         "offload_mean_tokens_per_s": r["offload_mean_bytes_per_s"]}
                                        for r in tr["tenants"]],
        }
    report["observed"] = reuse.observed_outcome(tables)
    tables.con.close()
    report["recommendations"] = {
        "durations": recommend.durations(report["reuse_gaps"], percentile=options.duration_percentile),
    }
    if options.curve:
        say("host-tier curve (simulator)")
        try:
            curve = recommend.host_curve(path, block_size=tables.block_size, gpu=options.gpu,
                                         multiples=options.host_multiples, max_requests=options.curve_requests,
                                         progress=advance, on_total=set_total, stage=say, family=options.family)
        except ValueError as exc:  # TraceError is a ValueError
            raise reuse.AnalyzeError(str(exc)) from None
        report["host_curve"] = curve
        host = curve["recommended_host_blocks"]
        rec = {"host_blocks": host, "block_size": tables.block_size, "gpu_blocks": curve["gpu_blocks"],
               "hit_rate_gain": curve["gain_at_knee"], "saturated": curve["saturated"]}
        if kvb is not None:
            rec["host_bytes"] = host * tables.block_size * kvb
        report["recommendations"]["host_tier"] = rec
    return report
