"""Server-rendered SVG charts (no script, no inline style: the CSP forbids both).

Pure functions from figures to markup; colours and fonts come from ``static/console.css``
through class names. Every number is formatted here, every label escaped.

Miss-ratio curve (x: GPU blocks on a log2 axis, y: estimated prompt-token hit rate)::

    100% ┤
         │            ●───────●        ● tenant / pool estimate at 0.5x 1x 2x 4x GPU
     50% ┤   ●───────●                 ◆ host tier 0x / 2x at today's GPU size
         │   ◆
      0% ┼───┬───────┬───────┬───────┬
            64     128     256     512   GPU blocks
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup, escape

W, H = 520, 240
LEFT, RIGHT, TOP, BOTTOM = 48, 16, 16, 40


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


def _gpu_points(points: Sequence[dict[str, Any]]) -> list[tuple[int, float, float | None]]:
    """(GPU blocks, hit rate, stderr) of the points at today's host size, by GPU size."""
    out = [(p["primary_blocks"], p["hit_rate"], p.get("hit_rate_stderr")) for p in points
           if p["host"] == "1x" and p["hit_rate"] is not None]
    return sorted(out)


def miss_ratio_chart(series: Sequence[tuple[str, str, Sequence[dict[str, Any]]]], *, title: str) -> Markup:
    """``series``: (label, css class, curve points as the admin API returns them)."""
    all_points = [p for _, _, pts in series for p in pts]
    if not all_points:
        return Markup('<p class="muted">No miss-ratio curve yet: it starts with the pool\'s first request '
                      '(and needs KVGATE_MRC_SAMPLE_RATE above 0).</p>')
    xs = sorted({p["primary_blocks"] for p in all_points})
    lo, hi = math.log2(max(1, xs[0])), math.log2(max(1, xs[-1]))
    span = (hi - lo) or 1.0

    def x(blocks: int) -> float:
        return LEFT + (math.log2(max(1, blocks)) - lo) / span * (W - LEFT - RIGHT)

    def y(rate: float) -> float:
        return TOP + (1.0 - max(0.0, min(1.0, rate))) * (H - TOP - BOTTOM)

    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(title)}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}"/>'
                     f'<text class="axis" x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{_pct(tick)}</text>')
    for blocks in xs:
        parts.append(f'<text class="axis" x="{x(blocks):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{blocks}</text>')
    parts.append(f'<text class="axis" x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 6}" text-anchor="middle">GPU blocks '
                 '(estimated prompt-token hit rate)</text>')
    legend_y = TOP + 4
    for label, css, pts in series:
        line = _gpu_points(pts)
        estimated = sum(1 for p in pts if p["hit_rate"] is not None)
        if line:
            coords = " ".join(f"{x(b):.1f},{y(r):.1f}" for b, r, _ in line)
            parts.append(f'<polyline class="series {escape(css)}" points="{coords}" data-series="{escape(label)}" '
                         f'data-points="{estimated}"/>')
            for b, r, err in line:
                if err:
                    parts.append(f'<line class="errbar {escape(css)}" x1="{x(b):.1f}" x2="{x(b):.1f}" '
                                 f'y1="{y(r - 2 * err):.1f}" y2="{y(r + 2 * err):.1f}"/>')
                parts.append(f'<circle class="dot {escape(css)}" cx="{x(b):.1f}" cy="{y(r):.1f}" r="3.5">'
                             f'<title>{escape(label)}: {b} GPU blocks → {_pct(r)}</title></circle>')
        for p in pts:
            if p["host"] != "1x" and p["hit_rate"] is not None:
                cx, cy = x(p["primary_blocks"]), y(p["hit_rate"])
                parts.append(f'<rect class="hostpt {escape(css)}" x="{cx - 4:.1f}" y="{cy - 4:.1f}" width="8" height="8" '
                             f'transform="rotate(45 {cx:.1f} {cy:.1f})"><title>{escape(label)}: host tier '
                             f'{escape(p["host"])} ({p["secondary_blocks"]} blocks) → {_pct(p["hit_rate"])}</title></rect>')
        parts.append(f'<rect class="swatch {escape(css)}" x="{W - RIGHT - 150}" y="{legend_y - 8}" width="10" height="10"/>'
                     f'<text class="legend" x="{W - RIGHT - 134}" y="{legend_y + 1}">{escape(label)}</text>')
        legend_y += 16
    parts.append("</svg>")
    return Markup("".join(parts))


def blocks_chart(rows: Sequence[tuple[str, float, float | None, float | None]], *, title: str) -> Markup:
    """Horizontal bars: (label, blocks held, limit line (quota) or None, tier capacity or None)."""
    bar_h, gap, label_w = 22, 14, 110
    height = TOP + len(rows) * (bar_h + gap) + 8
    width = W - label_w - RIGHT - 90
    parts = [f'<svg class="chart bars" viewBox="0 0 {W} {height}" role="img" aria-label="{escape(title)}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for i, (label, held, limit, capacity) in enumerate(rows):
        top = TOP + i * (bar_h + gap)
        scale_to = max(v for v in (capacity, limit, held, 1.0) if v)
        filled = width * min(1.0, held / scale_to)
        parts.append(f'<text class="legend" x="0" y="{top + bar_h * 0.7:.1f}">{escape(label)}</text>'
                     f'<rect class="track" x="{label_w}" y="{top}" width="{width}" height="{bar_h}"/>'
                     f'<rect class="fill" x="{label_w}" y="{top}" width="{filled:.1f}" height="{bar_h}" '
                     f'data-blocks="{held:.0f}"/>')
        if limit:
            lx = label_w + width * min(1.0, limit / scale_to)
            parts.append(f'<line class="limit" x1="{lx:.1f}" x2="{lx:.1f}" y1="{top - 3}" y2="{top + bar_h + 3}">'
                         f'<title>quota: {limit:.0f} blocks</title></line>')
        cap = f" / {capacity:.0f}" if capacity else ""
        parts.append(f'<text class="axis" x="{label_w + width + 8}" y="{top + bar_h * 0.7:.1f}">{held:.0f}{cap}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
