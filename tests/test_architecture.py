"""The architecture, checked: import-linter's contracts in pyproject.toml hold for the tree.

The contracts (``[tool.importlinter]``): the folders are layers (bench > server > engines |
tenants > retention, nothing imports upward, engines and tenants never import each other),
no package has an import cycle among its modules or sub-packages, and retention stays pure
(stdlib + numpy). The second test plants violations in a copy of the tree and checks that
each contract then breaks, so the first test cannot pass by checking nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("retention", "engines", "tenants", "server", "bench")
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports with ``root``'s pyproject.toml over ``root``'s packages."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", LINT, "--no-cache", "--no-logo"],
        cwd=root, env=env, capture_output=True, text=True, timeout=240,
    )


def test_contracts_hold() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for contract in ("Layers:", "No import cycles", "retention is pure"):
        assert contract in result.stdout
    assert "0 broken" in result.stdout


def _copy_sources(dst: Path) -> None:
    """The five packages' Python files (no data, no caches) and pyproject.toml."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or (not n.endswith(".py") and not (Path(directory) / n).is_dir())}

    for package in PACKAGES:
        shutil.copytree(ROOT / package, dst / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def test_planted_violations_break_each_contract(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    # Upward: the pure core importing the server layer.
    (tmp_path / "retention" / "scratch_upward.py").write_text("import server.gateway.app\n")
    # Sideways between independent layers: an engine importing the registry.
    (tmp_path / "engines" / "scratch_sideways.py").write_text("import tenants.db\n")
    # A cycle between two modules of one package.
    (tmp_path / "server" / "cli" / "scratch_a.py").write_text("from server.cli import scratch_b\n")
    (tmp_path / "server" / "cli" / "scratch_b.py").write_text("from server.cli import scratch_a\n")
    # A clock in the pure core.
    (tmp_path / "retention" / "scratch_clock.py").write_text("import time\n")

    result = lint(tmp_path)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "3 broken" in out, out
    assert "retention.scratch_upward -> server.gateway.app" in out
    assert "engines.scratch_sideways -> tenants.db" in out
    assert "No cycles are allowed in server.cli." in out
    assert ".scratch_b -> .scratch_a" in out or ".scratch_a -> .scratch_b" in out
    assert "retention.scratch_clock -> time" in out
