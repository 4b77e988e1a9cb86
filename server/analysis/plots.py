"""PNG plots of a ``kvgate analyze`` report (matplotlib, Agg backend; one figure per question).

Each function takes the report dict (the same one ``--json`` prints) and a directory, and
returns the file it wrote, or None when the report has nothing to draw for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reuse_gap_cdf(report: dict[str, Any], out: Path) -> Path | None:
    rows = [r for r in report["reuse_gaps"] if r["reuses"]]
    by_segment = [r for r in rows if r["tenant"] == "*" and r["segment"] != "*"]
    by_tenant = [r for r in rows if r["segment"] == "*" and r["tenant"] != "*"]
    if not by_segment:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, group, key, title in ((axes[0], by_segment, "segment", "by segment (all tenants)"),
                                  (axes[1], by_tenant, "tenant", "by tenant (all segments)")):
        for r in group:
            xs = [max(x, 1e-3) for x in r["cdf_s"]]
            ax.step(xs, [i / (len(xs) - 1) for i in range(len(xs))], where="post",
                    label=f"{r[key]} (n={r['reuses']:,}, p90 {r['p90_s']:.3g} s)")
        ax.set_xscale("log")
        ax.set_xlabel("reuse gap: seconds since the block's previous use")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("share of reuses")
    fig.tight_layout()
    path = out / "reuse_gap_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_curve(report: dict[str, Any], out: Path) -> Path | None:
    curve = report.get("host_curve")
    if not curve:
        return None
    plt = _plt()
    xs = [p["host_blocks"] for p in curve["points"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [100 * p["hit_rate"] for p in curve["points"]], marker="o", label="hit rate (GPU + host)")
    ax.plot(xs, [100 * p["gpu_hit_rate"] for p in curve["points"]], marker=".", ls="--", label="GPU hits")
    ax.plot(xs, [100 * p["host_hit_rate"] for p in curve["points"]], marker=".", ls=":", label="host hits")
    k = curve["knee_index"]
    ax.axvline(xs[k], color="k", alpha=0.4)
    ax.annotate(f"knee: {xs[k]:,} host blocks", (xs[k], 100 * curve["points"][k]["hit_rate"]),
                textcoords="offset points", xytext=(8, -14), fontsize=9)
    ax.set_xlabel(f"host tier (blocks of {report['overview']['block_size']} tokens); GPU {curve['gpu_blocks']:,} blocks")
    ax.set_ylabel("prompt-token hit rate (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out / "host_tier_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


MAX_TRANSFER_BINS = 4000
"""The transfer plot draws at most this many bins: a trace spanning 1e12 seconds is binned,
never drawn (or allocated) per second."""


def transfer_series(tr: dict[str, Any], *, max_bins: int = MAX_TRANSFER_BINS) -> dict[str, Any]:
    """What the transfer plot draws: KV bytes per second over *every* second of the trace's span.

    ``tr`` is the report's ``transfer`` section; its timeline lists active seconds only, and an
    idle second moves nothing, so it is drawn as 0 (joining active seconds alone drew a gap as
    sustained load). Invariant: at most ``max_bins`` bins of ``bin_s`` whole seconds each, the
    last one possibly shorter; a bin's value is the mean bytes per second over the seconds it
    covers (so binning keeps the area, i.e. the bytes moved). ``xs`` are bin starts, in seconds
    since the first active second.
    """
    timeline = tr["timeline"]
    if not timeline:
        return {"bin_s": 1, "xs": [], "onboard": [], "offload": []}
    t0 = timeline[0]["second"]
    span = int(timeline[-1]["second"] - t0) + 1
    bin_s = max(1, math.ceil(span / max_bins))
    bins = math.ceil(span / bin_s)
    onboard, offload = [0.0] * bins, [0.0] * bins
    for r in timeline:
        i = int(r["second"] - t0) // bin_s
        onboard[i] += r["onboard_bytes"]
        offload[i] += r["offload_bytes"]
    widths = [min(bin_s, span - i * bin_s) for i in range(bins)]
    return {"bin_s": bin_s, "xs": [i * bin_s for i in range(bins)],
            "onboard": [b / w for b, w in zip(onboard, widths, strict=True)],
            "offload": [b / w for b, w in zip(offload, widths, strict=True)]}


def transfer(report: dict[str, Any], out: Path) -> Path | None:
    tr = report.get("transfer")
    if not tr or tr.get("kv_bytes_per_token") is None or not tr["timeline"]:
        return None
    plt = _plt()
    series = transfer_series(tr)
    # steps: each bin is flat over the seconds it covers (a line between bins would invent a ramp)
    xs = [*series["xs"], series["xs"][-1] + series["bin_s"]]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for key, label, alpha in (("onboard", "host → GPU if every reuse were a host hit", 1.0),
                              ("offload", "GPU → host if every new block were offloaded", 0.7)):
        ys = [v / 1e9 for v in series[key]]
        ax.step(xs, [*ys, ys[-1]], where="post", lw=0.8, alpha=alpha, label=label)
    ax.axhline(tr["link_bytes_per_s"] / 1e9, color="r", ls="--", label=f"host-link budget {tr['link_bytes_per_s'] / 1e9:g} GB/s")
    ax.set_xlabel("trace time (s)" if series["bin_s"] == 1 else f"trace time (s; mean over {series['bin_s']:,} s bins)")
    ax.set_ylabel("KV GB per second")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = out / "kv_transfer.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def top_prefixes(report: dict[str, Any], out: Path) -> Path | None:
    rows = sorted(report["top_prefixes"], key=lambda r: r["tokens_saved"], reverse=True)[:12]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    labels = [f"{r['tenant']} · {r['blocks']} blocks → {r['ends_in']} (id {r['end_id']})" for r in rows]
    ax.barh(range(len(rows)), [r["tokens_saved"] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(r["tokens_saved"], i, f" {r['requests']:,} req", va="center", fontsize=8)
    ax.set_xlim(0, 1.15 * max(r["tokens_saved"] for r in rows))  # room for the request counts
    ax.set_xlabel("prompt tokens saved (unbounded cache)")
    ax.set_title("most shared prefixes")
    fig.tight_layout()
    path = out / "top_prefixes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def one_shot(report: dict[str, Any], out: Path) -> Path | None:
    rows = [r for r in report["reuse"] if r["tenant"] != "*" and r["segment"] != "*"]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [100 * r["reuse_share"] for r in rows], width=0.4, label="reused token share")
    ax.bar([x + 0.2 for x in xs], [100 * r["one_shot_share"] for r in rows], width=0.4, label="one-shot block share")
    ax.set_xticks(list(xs), [f"{r['tenant']}\n{r['segment']}" for r in rows], fontsize=8)
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "reuse_and_one_shot.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [fn(report, out) for fn in (reuse_gap_cdf, host_curve, transfer, top_prefixes, one_shot)]
    return [p for p in written if p is not None]
