"""Shared by the bench scripts: replace one ``<!-- bench:NAME -->`` section of docs/benchmarks.md,
and draw one small panel per workload."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"


def synthetic_trace() -> Path:
    """The public Mooncake synthetic trace: ``KVGATE_TRACE`` if set, else ``shared/traces/`` beside
    the checkout (or beside its parent folder), else that first path (a missing file is reported
    by the bench that opens it)."""
    if "KVGATE_TRACE" in os.environ:
        return Path(os.environ["KVGATE_TRACE"])
    checkout = Path(__file__).resolve().parents[1]
    candidates = [checkout.parent / _TRACE_NAME, checkout.parents[1] / _TRACE_NAME]
    return next((c for c in candidates if c.exists()), candidates[0])
HEADER = "# kvgate benchmarks\n\nEvery section is written by the bench script it names; rerun it to refresh.\n"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def seed_line(seed: int | None, draws: str) -> str:
    """The line under every section's title (and so in every bench's printed output): the
    seed of the bench's random inputs and what it draws, or ``None`` with what makes the
    inputs fixed. Same seed, same inputs: the counted figures (hit rates, token counts)
    repeat exactly on a re-run; timings are measurements and vary with the machine."""
    if seed is None:
        return f"Seed: none — no figure depends on a random draw ({draws})."
    return f"Seed: {seed} ({draws})."


def publish(name: str, body: str, *, write: bool, path: Path = BENCHMARKS) -> None:
    """Print a bench's section and, when ``write``, put it in ``path`` (``write_section``)."""
    print(body)
    if write:
        write_section(name, body, path)
        print(f"wrote {path.name} section bench:{name}")


def write_section(name: str, body: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the ``<!-- bench:name -->`` section of ``path``; nothing else changes."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def workload_grid(results: Sequence[dict], roles: dict[str, str], draw: Callable[..., None], path: Path, *,
                  xlabel: str, ylabel: str = "prompt-token hit rate (%)", row_height: float = 3.2) -> None:
    """One panel per workload result (4 a row), ``draw(ax, result)`` fills each; the first
    panel carries the legend. Titles name the workload and its role (tune / report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, row_height * rows), squeeze=False)
    for ax, result in zip(axes.flat, results):
        draw(ax, result)
        ax.set_title(f"{result['name']} ({roles[result['name']]})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.supxlabel(xlabel, fontsize=9)
    fig.supylabel(ylabel, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
