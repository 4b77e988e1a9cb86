"""Reliability suite fixtures: one real stack per session, and the figures the suite reports.

``make test`` runs the tests marked ``reliability`` (the fast subset);
``make test-reliability`` runs those and the ``reliability_full`` ones, prints every
figure and, with ``KVGATE_RELIABILITY_WRITE=1`` (set by the Makefile target), writes
them into the ``<!-- bench:suite -->`` section of docs/reliability.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server.gateway.stack import Stack, build_stack

TOKENS_PER_BLOCK = 16
PRIMARY_BLOCKS = 512
SECONDARY_BLOCKS = 512
# A modest engine for a 2-core machine: short outputs, batch of 16.
ENGINE_ARGS = ["--tokens-per-block", str(TOKENS_PER_BLOCK), "--primary-blocks", str(PRIMARY_BLOCKS),
               "--secondary-blocks", str(SECONDARY_BLOCKS), "--max-input-len", "1024", "--max-output-len", "128",
               "--max-batch-size", "16", "--max-num-tokens", "512"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
_FIGURES = pytest.StashKey[dict]()


class Figures:
    """Named figures a test measured; printed at the end of the run and optionally written to the doc."""

    def __init__(self, store: dict) -> None:
        self._store = store

    def record(self, section: str, **values: object) -> None:
        self._store.setdefault(section, {}).update(values)


@pytest.fixture(scope="session")
def figures(request) -> Figures:
    return Figures(request.config.stash.setdefault(_FIGURES, {}))


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    built = build_stack(tmp_path_factory.mktemp("reliability"), engine_args=ENGINE_ARGS,
                        tokens_per_block=TOKENS_PER_BLOCK, primary=PRIMARY_BLOCKS, secondary=SECONDARY_BLOCKS)
    yield built
    built.gateway.stop()
    built.engine.kill()


def render_figures(store: dict) -> str:
    lines = ["## Figures from the last `make test-reliability` run", "",
             "Written by `tests/reliability/conftest.py`; every figure below was measured by the test named.", ""]
    for section in sorted(store):
        lines.append(f"### {section}")
        lines.append("")
        for name, value in store[section].items():
            shown = json.dumps(value) if isinstance(value, (dict, list)) else value
            lines.append(f"- {name}: {shown}")
        lines.append("")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    store = config.stash.get(_FIGURES, {})
    if not store:
        return
    terminalreporter.write_sep("-", "reliability figures")
    terminalreporter.write_line(render_figures(store))
    if os.environ.get("KVGATE_RELIABILITY_WRITE") == "1":
        from bench.report import write_section

        write_section("suite", render_figures(store), path=DOC)
        terminalreporter.write_line(f"wrote {DOC} section bench:suite")
