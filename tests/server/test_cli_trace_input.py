"""`kvgate analyze` and `kvgate simulate` read the same traces the same way: no field is
coerced from the wrong JSON type, event lines are checked and left out, gzip files are read
whatever their name, other compressions are refused by name, and a byte that is not UTF-8 is
named by its line (blank lines counted)."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import create_cli

GOOD = {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2], "block_size": 4, "tenant": "a"}


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _run(*args: str) -> tuple[int, str]:
    """Exit code and the stderr (the one error line) or stdout of a command."""
    res = CliRunner().invoke(create_cli(), list(args))
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.stderr.strip() if res.exit_code else res.stdout


def _refused(trace: Path) -> tuple[str, str]:
    """The one-line errors of analyze and simulate for ``trace`` (both must exit 2)."""
    code, analyze = _run("analyze", str(trace), "--no-progress", "--no-curve")
    assert code == 2 and len(analyze.splitlines()) == 1, analyze
    code, simulate = _run("simulate", str(trace), "--no-progress")
    assert code == 2 and len(simulate.splitlines()) == 1, simulate
    return analyze, simulate


@pytest.mark.parametrize(("field", "value"), [
    ("hash_ids", [1.2, 2]), ("hash_ids", [True, 2]), ("hash_ids", [1, None]), ("hash_ids", [1, "2"]),
    ("input_length", "8"), ("input_length", 8.5), ("output_length", True),
    ("timestamp", True), ("timestamp", "0"), ("tenant", 5), ("tenant", ""), ("block_size", "4"),
    ("system_tokens", 1.5), ("context_tokens", False),
])
def test_a_field_of_the_wrong_type_is_refused_by_line_not_coerced(tmp_path: Path, field: str, value: object) -> None:
    """Line 3 (after a blank line) is bad: both commands name line 3 and the field."""
    trace = _write(tmp_path / "typed.jsonl", [GOOD, "", {**GOOD, field: value}])
    analyze, simulate = _refused(trace)
    assert analyze.startswith(f"error: {trace}: line 3: {field}"), analyze
    assert "line 3:" in simulate and field in simulate, simulate


def test_tenant_5_is_not_tenant_quoted_5(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tenants.jsonl", [{**GOOD, "tenant": "5"}, {**GOOD, "tenant": 5}])
    analyze, _ = _refused(trace)
    assert "line 2: tenant has the wrong type: expected a non-empty string, got 5" in analyze


def test_observed_fields_of_the_wrong_type_are_refused(tmp_path: Path) -> None:
    trace = _write(tmp_path / "observed.jsonl", [{**GOOD, "cached_gpu_tokens": "4", "ttft_ms": 3.0}])
    code, out = _run("analyze", str(trace), "--no-progress", "--no-curve")
    assert code == 2 and "line 1: cached_gpu_tokens has the wrong type" in out, out


def _chat(tmp_path: Path) -> tuple[list[dict], Path, Path]:
    from retention.workloads import ChatSpec, chat_trace

    lines = chat_trace(ChatSpec(duration_s=300.0, responses=True, delete_share=1.0), seed=3)
    assert any("op" in line for line in lines)  # the generator writes delete_response events
    with_events = _write(tmp_path / "events.jsonl", lines)
    without = _write(tmp_path / "requests.jsonl", [line for line in lines if "op" not in line])
    return lines, with_events, without


def test_event_lines_are_left_out_as_simulate_leaves_them_out(tmp_path: Path) -> None:
    _, with_events, without = _chat(tmp_path)
    args = ("--json", "--no-progress", "--gpu", "5%", "--host-multiples", "0,2")
    code, out = _run("analyze", str(with_events), *args)
    assert code == 0, out
    report = json.loads(out)
    code, plain = _run("analyze", str(without), *args)
    assert code == 0, plain
    expected = json.loads(plain)
    for key in ("overview", "reuse", "top_prefixes", "reuse_gaps", "host_curve"):
        assert report[key] == expected[key], key


@pytest.mark.parametrize(("event", "needle"), [
    ({"timestamp": 5, "op": "delete_response"}, "needs a response_id"),
    ({"timestamp": 5, "op": "forget", "response_id": "r"}, "unknown op"),
    ({"timestamp": 5, "op": "delete_response", "response_id": "r", "input_length": 8}, "unknown fields"),
    ({"timestamp": "5", "op": "delete_response", "response_id": "r"}, "timestamp"),
    # an op key makes an event line whatever its value: JSON null is no way to say "a request"
    ({**GOOD, "op": None}, "unknown op None"),
    ({"timestamp": 5, "op": None, "response_id": "r"}, "unknown op None"),
])
def test_a_bad_event_line_is_refused_as_simulate_refuses_it(tmp_path: Path, event: dict, needle: str) -> None:
    trace = _write(tmp_path / "bad_event.jsonl", [GOOD, "", event])
    analyze, simulate = _refused(trace)
    assert "line 3: " in analyze and needle in analyze, analyze
    assert analyze.split(f"{trace}: ", 1)[1] == simulate.removeprefix("error: "), (analyze, simulate)


def test_gzip_traces_read_like_plain_ones_whatever_their_name(tmp_path: Path) -> None:
    lines, plain, _ = _chat(tmp_path)
    for name in ("events.jsonl.gz", "events-gzipped.jsonl"):
        packed = tmp_path / name
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        analyze_args = ("--json", "--no-progress", "--gpu", "5%", "--host-multiples", "0,2")
        reports = [_run("analyze", str(p), *analyze_args) for p in (plain, packed)]
        assert [code for code, _ in reports] == [0, 0], reports
        first, second = (json.loads(out) for _, out in reports)
        assert first["host_curve"] == second["host_curve"] and first["reuse"] == second["reuse"]
        sims = [_run("simulate", str(p), "--json", "--no-progress", "-c", "5%") for p in (plain, packed)]
        assert [code for code, _ in sims] == [0, 0], sims
        assert json.loads(sims[0][1])["capacities"] == json.loads(sims[1][1])["capacities"]


def test_a_corrupt_gzip_trace_is_one_line_error(tmp_path: Path) -> None:
    trace = tmp_path / "cut.jsonl.gz"
    trace.write_bytes(gzip.compress(b"".join(json.dumps(GOOD).encode() + b"\n" for _ in range(50)))[:40])
    analyze, simulate = _refused(trace)
    assert "cannot read on" in analyze and "cannot read on" in simulate


def _zstd(data: bytes) -> bytes:
    """A real zstd frame (one raw block, under 128 KiB) without a zstd library: magic, a
    single-segment header with a 4-byte content size, the last block's header, the bytes."""
    assert len(data) < 1 << 17
    header = bytes([0xA0]) + struct.pack("<I", len(data))  # single segment, 4-byte content size
    return b"\x28\xb5\x2f\xfd" + header + (len(data) << 3 | 1).to_bytes(3, "little") + data


@pytest.mark.parametrize(("name", "compress"), [("zstd", _zstd), ("bzip2", bz2.compress), ("xz", lzma.compress)])
def test_a_compression_not_read_is_refused_by_name_not_as_utf8(tmp_path: Path, name: str,
                                                           compress: Callable[[bytes], bytes]) -> None:
    """Told by content (the name says .jsonl); the one line names the compression and gzip."""
    trace = tmp_path / "packed.jsonl"
    trace.write_bytes(compress(b"".join(json.dumps({**GOOD, "timestamp": t}).encode() + b"\n" for t in range(5))))
    analyze, simulate = _refused(trace)
    assert analyze.split(f"{trace}: ", 1)[1] == simulate.removeprefix("error: "), (analyze, simulate)
    assert f"{name}-compressed" in simulate and "decompress" in simulate and "gzip" in simulate, simulate
    assert "UTF-8" not in simulate, simulate


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_that_is_not_utf8_is_named(tmp_path: Path, gz: bool) -> None:
    good = json.dumps(GOOD).encode()
    data = b"\n".join([good, b"", good.replace(b'"a"', b'"\xff"'), good]) + b"\n"
    trace = tmp_path / ("latin.jsonl.gz" if gz else "latin.jsonl")
    trace.write_bytes(gzip.compress(data) if gz else data)
    analyze, simulate = _refused(trace)
    assert analyze == f"error: {trace}: line 3: not valid UTF-8"
    assert simulate == "error: line 3: not valid UTF-8"


def test_an_input_length_near_the_int64_limit_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The hash-count check's ceil used to overflow INT64 inside DuckDB (a traceback)."""
    trace = tmp_path / "big.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 9223372036854775807, "output_length": 1, "hash_ids": [1]}\n')
    result = CliRunner().invoke(create_cli(), ["analyze", str(trace), "--no-progress", "--no-curve"])
    assert result.exit_code == 2 and "line 1" in result.output and "hash_ids" in result.output, result.output
    assert "Traceback" not in result.output


def test_the_second_scan_for_a_null_op_runs_only_where_one_may_be(tmp_path) -> None:
    """A byte search decides whether the load needs DuckDB's second JSON scan (which doubled the load
    of a large trace): a null op or any escape (a key may be spelled with one) says yes, gzip too."""
    import gzip

    from server.analysis.reuse import _may_have_null_op

    cases = {'{"op": "delete_response"}\n{"x": 1}\n': False, '{"x": 1}\n{"op" :  null}\n': True,
             '{"\\u006fp": null}\n': True}
    for index, (text, expected) in enumerate(cases.items()):
        plain, packed = tmp_path / f"{index}.jsonl", tmp_path / f"{index}.jsonl.gz"
        plain.write_text(text)
        packed.write_bytes(gzip.compress(text.encode()))
        assert _may_have_null_op(plain) is expected and _may_have_null_op(packed) is expected, text
    straddling = tmp_path / "straddling.jsonl"  # the match crosses a chunk boundary
    straddling.write_text("x" * 10 + '{"op": null}\n')
    assert _may_have_null_op(straddling, chunk=13)
