"""The conversation bench's section regenerates: same seed, same table; written between its markers."""

from __future__ import annotations

import pytest

from bench.retention.conversation import run
from bench.report import write_section

pytestmark = pytest.mark.slow


def table(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("| agent-loop")]


def test_the_conversation_section_repeats_and_is_written_in_place(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first, raw = run(1, (0.02,), (0,), ["agent-loop"], grid=False, limit=400)
    second, _ = run(1, (0.02,), (0,), ["agent-loop"], grid=False, limit=400)
    # 4 age-based, 2 +conv, 2 +conv+demote, 2 +conv+end, 3 +end (no hold), 3 diagnostics (no duel, end
    # ungated, whole quota), best age-based, Belady
    assert table(first) == table(second) and len(table(first)) == 18
    assert sum("+conv+demote |" in line for line in table(first)) == 2
    assert sum("+conv+end |" in line for line in table(first)) == 2
    assert {"| lru+end |", "| protect+end |", "| adaptive+end |"} <= {
        "| " + line.split(" | ")[3] + " |" for line in table(first)}
    # the recommended configuration (adaptive+end) is judged against the best age-based, the hold variants apart
    assert raw["verdict"]["recommended_cells"] == 1 and raw["verdict"]["hold_cells"] == 3
    assert "for the configuration the gateway recommends for agent tool loops (adaptive+end" in first
    assert "above this family's ceiling" in first
    assert "**Demote requests**" in first  # agent-loop deletes and ends runs: the demote counts are reported
    assert "Seed: 0 " in first.splitlines()[2]
    assert raw["verdict"]["target"] is not None  # the agent-loop check is computed from the figures
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# kvgate benchmarks\n\n<!-- bench:conversation -->\nSTALE-FIGURES\n<!-- /bench:conversation -->\n\ntail\n")
    write_section("conversation", first, doc)
    text = doc.read_text()
    assert "STALE-FIGURES" not in text and text.endswith("tail\n") and "| agent-loop (report)" in text
