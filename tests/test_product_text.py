"""The product's text names no backlog item: targets are stated as targets.

"issue 18", "Issue 13's bar", "(#13)" or "#7" mean nothing to a reader of the product.
Scanned: README.md, docs/, bench/ (whose strings become docs/benchmarks.md), the code and
deploy folders, and tests/ (except this file, whose examples must stay). Citations of
upstream projects stay: their numbers are long ("TensorRT-LLM PR #7106",
"NVIDIA/TensorRT-LLM issue #3130"), the backlog's have one or two digits.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "docs", "bench", "retention", "engines", "tenants", "server", "deploy", "tests")
EXCLUDED = {Path(__file__).resolve()}  # this file: its examples name backlog items on purpose
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".pbtxt", ".j2", ".tpl", ".json", ".ini", ".sh", ".cfg"}
BACKLOG = re.compile(
    r"\bissues?\s+#?\d{1,2}\b"  # issue 18, Issue 13's, issues 7
    r"|\(#\d{1,2}\)"  # (#13)
    r"|(?<![\w&/#])#\d{1,2}\b(?![\w-])",  # #7 (not &#13; entities, URL anchors or hex colours)
    re.IGNORECASE,
)


def backlog_references(text: str) -> list[str]:
    return [m.group(0) for m in BACKLOG.finditer(text)]


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
            continue
        out.extend(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts)
    return [p for p in out if p.resolve() not in EXCLUDED]


def test_the_pattern_tells_backlog_from_citations() -> None:
    for backlog in ("structured outputs (issue 18)", "Issue 13's bar", "done (#13)", "see #7 for", "issue #4"):
        assert backlog_references(backlog), backlog
    for citation in ("TensorRT-LLM PR #7106", "NVIDIA/TensorRT-LLM issue #3130", "color: #1f77b4", "&#13;",
                     "docs/page.md#3-layers", "issue tracker"):
        assert not backlog_references(citation), citation


def test_no_backlog_references_in_product_text() -> None:
    found = []
    for path in _files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if refs := backlog_references(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {refs}")
    assert not found, "\n".join(found)
