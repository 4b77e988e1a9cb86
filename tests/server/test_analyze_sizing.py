"""`kvgate analyze`: bounded work on a trace's time span, the host-tier knee rule on curves
that bend late, the transfer plot's data over idle seconds, the units of the host-tier
recommendation, options refused before the trace is read, and shown gains that match the
shown rates."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.analysis import plots, recommend
from server.analysis.reuse import idle_percentile
from server.cli import create_cli

SYNTHETIC = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
TINY = [  # block size 4, 7 distinct blocks, no tenants or segments
    {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3], "block_size": 4},
    {"timestamp": 1000, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4], "block_size": 4},
    {"timestamp": 3000, "input_length": 8, "output_length": 1, "hash_ids": [5, 6], "block_size": 4},
    {"timestamp": 4000, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 4},
    {"timestamp": 4000, "input_length": 8, "output_length": 1, "hash_ids": [5, 7], "block_size": 4},
]


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(create_cli(), ["analyze", *args])
    return res.exit_code, res.output


def _listed_percentile(values: list[float], zeros: int, q: float) -> float:
    """The percentile as it was computed before: the idle seconds listed as zeros."""
    full = sorted(values + [0.0] * zeros)
    if not full:
        return 0.0
    k = (len(full) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return full[lo] + (full[hi] - full[lo]) * (k - lo)


def test_idle_seconds_are_counted_not_listed() -> None:
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.choice([0.0, rng.uniform(0, 1e9)]) for _ in range(rng.randrange(0, 12))]
        zeros = rng.randrange(0, 15)
        for q in (0.0, 0.3, 0.5, 0.9, 0.99, 1.0):
            assert idle_percentile(values, zeros, q) == _listed_percentile(values, zeros, q), (values, zeros, q)
    assert idle_percentile([5.0], 10**15, 0.99) == 0.0  # no list of 1e15 zeros


def test_a_trace_spanning_1e12_seconds_is_analysed_in_bounded_memory(tmp_path: Path) -> None:
    trace = _write(tmp_path / "far.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1e15, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]},
    ])
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--kv-bytes-per-token", "10",
                     "--plots", str(tmp_path / "plots"))
    assert code == 0, out[-2000:]
    tr = json.loads(out)["transfer"]
    assert tr["seconds"] == 10**12 + 1 and tr["onboard_p99_bytes_per_s"] == 0.0
    assert tr["onboard_max_bytes_per_s"] == 600 * 10
    series = plots.transfer_series(tr)
    assert len(series["xs"]) <= plots.MAX_TRANSFER_BINS and series["bin_s"] > 1
    assert (tmp_path / "plots" / "kv_transfer.png").is_file()


def test_the_transfer_plot_draws_idle_seconds_as_zero(tmp_path: Path) -> None:
    """Three requests at 0, 10 and 20 s: 21 seconds drawn, 18 of them idle (0), not a line across."""
    trace = _write(tmp_path / "spaced.jsonl", [
        {"timestamp": t, "input_length": 8, "output_length": 1, "hash_ids": [1, 2], "block_size": 4}
        for t in (0, 10_000, 20_000)])
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--kv-bytes-per-token", "10")
    assert code == 0, out
    tr = json.loads(out)["transfer"]
    series = plots.transfer_series(tr)
    assert series["bin_s"] == 1 and series["xs"] == list(range(21))
    assert series["offload"] == [80.0] + [0.0] * 20  # the first request's 8 new tokens x 10 bytes
    assert series["onboard"] == [0.0] * 10 + [80.0] + [0.0] * 9 + [80.0]
    binned = plots.transfer_series(tr, max_bins=4)  # 6-second bins, the last one 3 s wide
    assert binned["bin_s"] == 6 and binned["xs"] == [0, 6, 12, 18]
    assert binned["onboard"] == [0.0, 80.0 / 6, 0.0, 80.0 / 3]  # means per second: the bytes moved are kept
    assert sum(v * w for v, w in zip(binned["onboard"], (6, 6, 6, 3), strict=True)) == pytest.approx(160.0)


def test_a_knee_that_misses_most_of_the_gain_is_not_saturated() -> None:
    # the first 200 lines of the synthetic trace at GPU 100 blocks: a step to 100, flat, then rising again
    audit = ([0, 50, 100, 200, 400, 800, 1600, 3200], [.00538, .00942, .01634, .01634, .01826, .01922, .0371, .06171])
    assert recommend.knee(*audit) == (7, False)
    # the documented examples keep their knees: the curve has flattened past them
    synthetic = ([0, 439, 878, 1756, 3512, 7024, 14048, 28096], [.080, .112, .137, .183, .275, .386, .536, .636])
    assert recommend.knee(*synthetic) == (6, True)
    capture = ([0, 48, 96, 192, 384, 768], [.676, .704, .713, .713, .713, .713])
    assert recommend.knee(*capture) == (1, True)
    # a last segment as steep as the chord's mean: still rising, whatever the bend before it
    assert recommend.knee([0, 1, 2, 4, 8], [0.0, 0.3, 0.35, 0.4, 0.6]) == (4, False)


def test_the_recommendation_names_its_block_size_and_its_bound(tmp_path: Path) -> None:
    if not SYNTHETIC.is_file():
        pytest.skip("the shared synthetic trace is not on this machine")
    with SYNTHETIC.open() as handle:
        trace = tmp_path / "head.jsonl"
        trace.write_text("".join(next(handle) for _ in range(200)))
    args = (str(trace), "--no-progress", "--kv-bytes-per-token", "65536", "--host-multiples", "0,1,16,32")
    code, out = _run(*args, "--json")
    assert code == 0, out
    report = json.loads(out)
    host, curve = report["recommendations"]["host_tier"], report["host_curve"]
    assert host["block_size"] == 512 and host["saturated"] is False
    assert host["host_blocks"] == curve["points"][-1]["host_blocks"] == 3200
    code, out = _run(*args)
    assert code == 0, out
    text = " ".join(out.split())
    assert "recommended host tier: 3,200 blocks of 512 tokens (1,638,400 tokens, 107.37 GB of KV)" in text
    assert "this is a lower bound, try larger --host-multiples" in text


def test_the_shown_gain_is_the_difference_of_the_shown_rates() -> None:
    sentence = recommend.verdict(0.00538, {"trtllm-default": 0.00538, "protect": 0.0059}, 0.02076, "estimate")
    assert "`protect` +0.1 points over LRU (0.5% → 0.6%)" in sentence
    assert "the age-based figure, +1.6 points, is an estimate" in sentence  # 2.1% - 0.5%
    sentence = recommend.verdict(0.08044, {"trtllm-default": 0.08044, "adaptive": 0.08756}, 0.106, "bound")
    assert "`adaptive` +0.8 points over LRU (8.0% → 8.8%)" in sentence and "at most 2.6 points" in sentence


@pytest.fixture
def no_trace_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the trace is loaded: these options must be refused before the DuckDB pass."""
    from server.analysis import reuse

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the trace was read before the options were checked")

    monkeypatch.setattr(reuse, "load_trace", refuse)


@pytest.mark.parametrize(("args", "needle"), [
    (["--gpu", "abc"], "--gpu 'abc' must be a block count"),
    (["--gpu", "0"], "--gpu '0' must be a block count"),
    (["--gpu", "1e308%"], "a share above 1600%"),
    (["--memory-limit", "-5GB"], "--memory-limit '-5GB' must be a positive amount"),
    (["--memory-limit", "0GB"], "--memory-limit '0GB' must be a positive amount"),
    (["--memory-limit", "lots"], "--memory-limit 'lots' must be a positive amount"),
    (["--memory-limit", "5ki"], "--memory-limit '5ki': Unknown unit"),
    (["--kv-dtype", "int4"], "--kv-dtype int4 applies only with --model"),
    (["--kv-dtype", "fp16", "--kv-bytes-per-token", "2"], "applies only with --model"),
])
def test_options_are_refused_before_the_trace_is_read(tmp_path: Path, no_trace_read: None, args: list[str],
                                                      needle: str) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    res = CliRunner().invoke(create_cli(), ["analyze", str(trace), "--no-progress", *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert needle in res.stderr and "Traceback" not in res.output, res.stderr


def test_accepted_memory_limits_and_a_host_multiple_past_float_range(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    for limit in ("512MiB", "1.5GB", "50%"):
        code, out = _run(str(trace), "--no-progress", "--no-curve", "--json", "--memory-limit", limit)
        assert code == 0, (limit, out)
    # 1e308 x the GPU is infinite: capped like any host tier past what the trace can fill, no OverflowError
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "2", "--host-multiples", "0,1e308")
    assert code == 0, out
    assert [p["host_blocks"] for p in json.loads(out)["host_curve"]["points"]] == [0, 16 * 7]
