"""The routing-families bench reuses cached figures only for the same router and knobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.routing.families import (BOUNDED, EXTRAS, FADING, FORGIVING, SELF_TUNING, SQUARED, TUNINGS, WIDE,
                                     fingerprint)

ROOT = Path(__file__).resolve().parents[2]


def test_an_extra_router_is_cached_by_its_knobs_defaults_included() -> None:
    default = fingerprint("kv-adaptive", ("kv-adaptive", {}, {}))
    # the same knobs under another label share a replay; a changed knob (or default) does not
    assert fingerprint("tuning: plain", ("kv-adaptive", {}, {"forgive": 0.0})) == default
    assert fingerprint("kv-adaptive", ("kv-adaptive", {}, {"forgive": 3.0})) != default
    assert fingerprint("kv-adaptive", ("kv-adaptive", {"balance_rel": 2.0}, {})) != default
    assert fingerprint("kv-aware", ("kv-aware", {}, {})) != default


def test_an_unknown_router_is_refused_before_any_replay() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "routing" / "families.py"), "--routers", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "unknown --routers nope" in run.stderr


def test_the_bounded_scale_is_replayed_and_judged_over_the_whole_grid() -> None:
    """The scale's bounds chosen on the tune families ([½, 4]) are an extra router of the grid, judged against
    kv-aware by the adoption rule like every self-tuning row; the rows tried with the defaults' bounds pin
    them, so a change of ``BandTuning``'s defaults cannot silently change (or reuse) their figures."""
    assert EXTRAS[BOUNDED[0]] == ("kv-adaptive", {}, {"min_scale": 0.5, "max_scale": 4.0})
    assert BOUNDED[0] in SELF_TUNING
    assert any(knobs == BOUNDED[1] for _, knobs in TUNINGS)
    for _, knobs in (FORGIVING, FADING, SQUARED):
        assert {k: knobs[k] for k in WIDE} == WIDE
    bounded = fingerprint(BOUNDED[0], EXTRAS[BOUNDED[0]])
    assert bounded != fingerprint("kv-adaptive", ("kv-adaptive", {}, {}))
    assert bounded == fingerprint("tuning: bounds", ("kv-adaptive", {}, {"max_scale": 4.0, "min_scale": 0.5}))


def test_the_knob_pass_never_overwrites_the_committed_table_by_default() -> None:
    """``--tune-only`` writes only where it is told: the committed table is the one the section shows, with its cut."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "routing" / "families.py"), "--tune-only"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "--tune-only writes its table to --tune-json FILE" in run.stderr


def test_a_cache_replayed_with_other_defaults_is_refused(tmp_path) -> None:
    """The grid's own rows are keyed by setting alone, so a cache records the kv-aware defaults it holds."""
    import pytest

    from bench.routing.families import stamp_defaults

    cache = tmp_path / "grid.jsonl"
    stamp_defaults(cache)  # first use: recorded
    stamp_defaults(cache)  # same defaults: accepted
    assert cache.with_suffix(".defaults").read_text() == fingerprint("kv-aware", ("kv-aware", {}, {}))
    cache.with_suffix(".defaults").write_text(fingerprint("kv-aware", ("kv-aware", {"balance_rel": 1.5}, {})))
    with pytest.raises(SystemExit, match="other kv-aware defaults"):
        stamp_defaults(cache)
