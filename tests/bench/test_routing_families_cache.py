"""The routing-families bench reuses cached figures only for the same router and knobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.routing_families import fingerprint

ROOT = Path(__file__).resolve().parents[2]


def test_an_extra_router_is_cached_by_its_knobs_defaults_included() -> None:
    default = fingerprint("kv-adaptive", ("kv-adaptive", {}, {}))
    # the same knobs under another label share a replay; a changed knob (or default) does not
    assert fingerprint("tuning: plain", ("kv-adaptive", {}, {"forgive": 0.0})) == default
    assert fingerprint("kv-adaptive", ("kv-adaptive", {}, {"forgive": 3.0})) != default
    assert fingerprint("kv-adaptive", ("kv-adaptive", {"balance_rel": 2.0}, {})) != default
    assert fingerprint("kv-aware", ("kv-aware", {}, {})) != default


def test_an_unknown_router_is_refused_before_any_replay() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_families.py"), "--routers", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "unknown --routers nope" in run.stderr
