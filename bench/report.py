"""Shared by the bench scripts: replace one ``<!-- bench:NAME -->`` section of docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# kvgate benchmarks\n\nEvery section is written by the bench script it names; rerun it to refresh.\n"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


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
