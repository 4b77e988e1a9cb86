"""`kvgate analyze`: figures against a hand-computed tiny trace, the synthetic trace (a slice)
against an independent computation, the knee rule, and clear errors (exit 2) for bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.analysis.recommend import knee, round_up_2sig
from server.cli import create_cli

SYNTHETIC = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")

# block size 4. Hand-computed figures below refer to these lines.
TINY = [
    {"timestamp": 0, "tenant": "x", "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3],
     "system_tokens": 4, "context_tokens": 8, "block_size": 4},
    {"timestamp": 1000, "tenant": "x", "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4],
     "system_tokens": 4, "context_tokens": 8, "block_size": 4},
    {"timestamp": 3000, "tenant": "y", "input_length": 8, "output_length": 1, "hash_ids": [5, 6],
     "system_tokens": 4, "context_tokens": 4, "block_size": 4},
    {"timestamp": 4000, "tenant": "x", "input_length": 4, "output_length": 1, "hash_ids": [1],
     "system_tokens": 4, "context_tokens": 4, "block_size": 4},
    {"timestamp": 4000, "tenant": "y", "input_length": 8, "output_length": 1, "hash_ids": [5, 7],
     "system_tokens": 4, "context_tokens": 4, "block_size": 4},
]


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(create_cli(), ["analyze", *args])
    return res.exit_code, res.output


def test_tiny_trace_figures_match_hand_computation(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--kv-bytes-per-token", "10",
                     "--host-link-gb-s", "9e-8", "--plots", str(tmp_path / "plots"))
    assert code == 0, out
    r = json.loads(out)
    ov = r["overview"]
    assert (ov["requests"], ov["prompt_tokens"], ov["distinct_blocks"], ov["block_uses"], ov["duration_s"],
            ov["tenants"], ov["block_size"]) == (5, 42, 7, 11, 4.0, 2, 4)

    reuse = {(x["tenant"], x["segment"]): x for x in r["reuse"]}
    assert (reuse["*", "*"]["tokens"], reuse["*", "*"]["reused_tokens"]) == (42, 16)
    assert (reuse["*", "*"]["distinct_blocks"], reuse["*", "*"]["one_shot_blocks"]) == (7, 4)
    x, y = reuse["x", "*"], reuse["y", "*"]
    assert (x["tokens"], x["reused_tokens"], x["reuse_share"]) == (26, 12, 12 / 26)
    assert (x["distinct_blocks"], x["one_shot_share"], x["one_shot_token_share"]) == (4, 0.5, 6 / 14)
    assert (y["tokens"], y["reused_tokens"], y["one_shot_share"], y["one_shot_token_share"]) == (16, 4, 2 / 3, 8 / 12)
    assert (reuse["x", "system"]["tokens"], reuse["x", "system"]["reused_tokens"]) == (12, 8)
    assert (reuse["x", "context"]["tokens"], reuse["x", "context"]["reused_tokens"]) == (8, 4)
    assert (reuse["x", "turn"]["tokens"], reuse["x", "turn"]["reused_tokens"]) == (6, 0)

    prefixes = [(p["tenant"], p["end_id"], p["blocks"], p["ends_in"], p["requests"], p["tokens_saved"])
                for p in r["top_prefixes"]]
    assert prefixes == [("x", 2, 2, "context", 1, 8), ("x", 1, 1, "system", 1, 4), ("y", 5, 1, "system", 1, 4)]

    gaps = {(g["tenant"], g["segment"]): g for g in r["reuse_gaps"]}
    total = gaps["*", "*"]
    assert (total["reuses"], total["p50_s"], total["max_s"]) == (4, 1.0, 3.0)
    assert math.isclose(total["p90_s"], 2.4)  # [1, 1, 1, 3]: 1 + 0.7 * 2
    assert (gaps["x", "*"]["reuses"], gaps["y", "*"]["reuses"], gaps["x", "system"]["max_s"]) == (3, 1, 3.0)
    assert total["cdf_s"][0] == 1.0 and total["cdf_s"][-1] == 3.0 and len(total["cdf_s"]) == 101

    tr = r["transfer"]
    assert tr["seconds"] == 5
    assert (tr["onboard_mean_bytes_per_s"], tr["offload_mean_bytes_per_s"]) == (32.0, 52.0)
    assert (tr["onboard_max_bytes_per_s"], tr["offload_max_bytes_per_s"]) == (80.0, 100.0)
    assert tr["seconds_over_budget"] == 3  # 100, 120, 80, 120 bytes against 90
    assert r["observed"] == []  # a Mooncake-style trace carries no outcome

    durations = {(d["tenant"], d["segment"]): d for d in r["recommendations"]["durations"]}
    assert durations["*", "*"]["duration_ms"] is None and "only 4 reuses" in durations["*", "*"]["reason"]
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "reuse_gap_cdf.png", "kv_transfer.png", "top_prefixes.png", "reuse_and_one_shot.png"}


def test_tables_and_host_curve_on_the_tiny_trace(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    code, out = _run(str(trace), "--no-progress", "--gpu", "1", "--host-multiples", "0,1,4")
    assert code == 0, out
    for title in ("reuse and one-shot blocks", "most shared prefixes", "reuse gaps", "host-link load",
                  "host-tier curve", "recommended host tier", "recommended retention durations"):
        assert title in out
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "1", "--host-multiples", "0,1,4")
    curve = json.loads(out)["host_curve"]
    assert [p["host_blocks"] for p in curve["points"]] == [0, 1, 4] and curve["gpu_blocks"] == 1
    assert "retention headroom" in _run(str(trace), "--no-progress", "--gpu", "1")[1]


def test_retention_headroom_orders_lru_the_age_based_figure_and_belady(tmp_path: Path) -> None:
    """LRU <= the age-based figure (LRU is age-based) and LRU <= Belady (the single-tier optimum);
    the candidates are replayed, the headroom is never below the best replayed gain, and the
    verdict follows the replays. A file says nothing of its origin: the figure is an estimate."""
    from retention.workloads import ChatSpec, chat_trace

    trace = _write(tmp_path / "chat.jsonl", chat_trace(ChatSpec(duration_s=600.0), seed=1))
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "1%", "--host-multiples", "0,4")
    assert code == 0, out
    ret = json.loads(out)["host_curve"]["retention"]
    lru = json.loads(out)["host_curve"]["points"][0]["hit_rate"]
    assert ret["lru"] == lru == ret["replayed"]["trtllm-default"]  # the curve's host-0 point: not replayed twice
    assert set(ret["replayed"]) == {"trtllm-default", "adaptive", "protect"}
    assert 0 < ret["lru"] <= ret["age_based"] <= ret["belady"]
    assert all(rate <= ret["belady"] for rate in ret["replayed"].values())
    best = max(ret["replayed"].values())
    assert ret["best_gain"] == pytest.approx(best - lru) and ret["replayed"][ret["best_policy"]] == best
    assert ret["headroom"] == pytest.approx(max(best - lru, ret["age_based"] - lru))
    assert ret["age_based_kind"] == "estimate"
    assert ("size capacity" in ret["verdict"]) == (ret["best_gain"] < 0.01)
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "100%", "--host-multiples", "0,1")
    roomy = json.loads(out)["host_curve"]["retention"]  # everything fits: nothing for retention to add
    assert roomy["lru"] == roomy["age_based"] and "size capacity" in roomy["verdict"]


def test_verdict_names_the_replayed_gain_where_adaptive_passes_the_estimate(tmp_path: Path) -> None:
    """On the generated ``api`` family (200 Zipf system prompts: popularity, which adaptive's
    bands read and age does not) at 55 GPU blocks, ``adaptive`` replayed hits more than the
    age-based estimate. The verdict names the replayed gain, the estimate is labelled one, and
    the replay is the one ``kvgate simulate -p adaptive --host 0`` measures."""
    from retention.workloads import ApiSpec, api_trace

    trace = _write(tmp_path / "api.jsonl", api_trace(ApiSpec(), seed=0))
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "55", "--host-multiples", "0,1")
    assert code == 0, out
    ret = json.loads(out)["host_curve"]["retention"]
    adaptive, lru = ret["replayed"]["adaptive"], ret["lru"]
    assert adaptive > ret["age_based"]  # the situation under test: a policy passes the estimate
    assert ret["age_based_kind"] == "estimate"
    assert ret["best_policy"] == "adaptive" and ret["headroom"] == pytest.approx(adaptive - lru)
    shown = round(100 * adaptive, 1) - round(100 * lru, 1)  # the gain of the rates as printed
    replayed_gain = f"`adaptive` {shown:+.1f} points over LRU"
    assert replayed_gain in ret["verdict"] and "adaptive class" in ret["verdict"]
    room = round(100 * ret["age_based"], 1) - round(100 * lru, 1)
    assert f"{room:+.1f} points, is an estimate" in ret["verdict"]
    assert "passes it" in ret["verdict"] and "size capacity" not in ret["verdict"]

    res = CliRunner().invoke(create_cli(), ["simulate", str(trace), "-p", "adaptive", "-c", "55", "--host", "0",
                                            "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["capacities"][0]["policies"]["adaptive"]["hit_rate"] == pytest.approx(adaptive)

    code, out = _run(str(trace), "--no-progress", "--gpu", "55", "--host-multiples", "0,1")
    assert code == 0, out
    assert "adaptive (replayed)" in out and "age-based (estimate)" in out and replayed_gain in " ".join(out.split())


def test_the_age_based_figure_is_a_bound_only_for_iid_families() -> None:
    """``hit_density.ceiling_kind``: a bound for the generated chat families (i.i.d. think
    times), an estimate for any other family and for a trace of unknown origin."""
    import itertools

    from retention.simulation.hit_density import ceiling_kind
    from retention.simulation.simulator import SimConfig, request_hashes
    from retention.trace import parse_trace
    from retention.workloads import ChatSpec, chat_trace
    from server.analysis.recommend import retention_headroom

    assert [ceiling_kind(f) for f in ("chat", "chat-long", "api", "rag-chat", None)] == \
        ["bound", "bound", "estimate", "estimate", "estimate"]
    requests = parse_trace(json.dumps(line) for line in chat_trace(ChatSpec(duration_s=300.0), seed=2))
    hashes = request_hashes(requests, SimConfig())
    replayed = itertools.count()
    bound = retention_headroom(requests, hashes, 40, 512, family="chat", progress=lambda n: next(replayed))
    assert bound["age_based_kind"] == "bound" and "(a bound: reuse gaps here are i.i.d.)" in bound["verdict"]
    assert next(replayed) > 0  # the replays report progress
    unknown = retention_headroom(requests, hashes, 40, 512)
    assert unknown["age_based_kind"] == "estimate" and "is an estimate on this trace" in unknown["verdict"]
    assert {k: v for k, v in bound.items() if k not in ("age_based_kind", "verdict")} == \
        {k: v for k, v in unknown.items() if k not in ("age_based_kind", "verdict")}


def test_synthetic_trace_slice_against_an_independent_count(tmp_path: Path) -> None:
    if not SYNTHETIC.is_file():
        pytest.skip("the shared synthetic trace is not on this machine")
    with SYNTHETIC.open() as handle:
        lines = [next(handle) for _ in range(400)]
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(lines))
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--kv-bytes-per-token", "131072")
    assert code == 0, out
    r = json.loads(out)
    reqs = sorted((json.loads(x) for x in lines), key=lambda o: o["timestamp"])  # stable: file order on ties
    seen: set[int] = set()
    uses: dict[int, int] = {}
    reused = tokens = 0
    for req in reqs:
        for pos, h in enumerate(req["hash_ids"]):
            n = min(512, req["input_length"] - pos * 512)
            tokens += n
            reused += n if h in seen else 0
            uses[h] = uses.get(h, 0) + 1
        seen.update(req["hash_ids"])
    total = next(x for x in r["reuse"] if (x["tenant"], x["segment"]) == ("*", "*"))
    assert (total["tokens"], total["reused_tokens"]) == (tokens, reused)
    assert total["distinct_blocks"] == len(uses)
    assert total["one_shot_blocks"] == sum(1 for n in uses.values() if n == 1)
    assert r["overview"]["block_size"] == 512 and r["transfer"]["kv_bytes_per_token"] == 131072


def test_knee_rule() -> None:
    # concave: scaled distances above the chord 0.52, 0.65, 0.47, 0.0 at x = 1, 2, 4, 8
    assert knee([0, 1, 2, 4, 8], [0.1, 0.3, 0.38, 0.40, 0.41]) == (2, True)
    assert knee([0, 1, 2], [0.2, 0.2, 0.203]) == (0, True)  # flat: no host tier
    assert knee([0, 1, 2, 4], [0.1, 0.11, 0.13, 0.3]) == (3, False)  # still rising: lower bound
    assert round_up_2sig(281.7) == 290 and round_up_2sig(1000) == 1000 and math.isclose(round_up_2sig(0.01234), 0.013)


@pytest.mark.parametrize(("lines", "needle"), [
    (['{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}', "not json"], "line 2"),
    ([{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}], "line 1: the number of hash_ids"),
    ([{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [2**31]}], "line 1: hash_ids"),
    ([{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}], "line 1: timestamp"),
    ([{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]},
      {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}], "line 2: input_length"),
    ([{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 4},
      {"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 8}], "different block sizes"),
    ([{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2], "block_size": 4,
       "system_tokens": 6, "context_tokens": 5}], "line 1: need system_tokens"),
    ([{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]},
      {"timestamp": "soon", "input_length": 4, "output_length": 1, "hash_ids": [1]}], "line 2: timestamp has the wrong type"),
    ([{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, None]}], "line 1: hash_ids"),
    ([], "no requests"),
])
def test_bad_traces_exit_2(tmp_path: Path, lines: list, needle: str) -> None:
    trace = _write(tmp_path / "bad.jsonl", lines)
    code, out = _run(str(trace), "--no-progress", "--no-curve")
    assert code == 2 and needle in out, out


def test_bad_options_exit_2(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    for args, needle in ((["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
                         (["--kv-bytes-per-token", "1", "--model", "llama-3.1-8b"], "not both"),
                         (["--host-multiples", "1"], "--host-multiples"),
                         (["--gpu", "lots"], "--gpu"),
                         (["--block-size", "8"], "block_size 4 but --block-size 8")):
        code, out = _run(str(trace), "--no-progress", *args)
        assert code == 2 and needle in out, (args, out)
    code, out = _run(str(tmp_path / "missing.jsonl"), "--no-progress")
    assert code == 2 and "not found" in out


def test_model_shape_gives_the_kv_bytes_per_token(tmp_path: Path) -> None:
    """``--model`` uses the shapes of ``kvgate plan`` (engines/capacity, branch i17-plan) when present."""
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--model", "llama-3.1-8b")
    try:
        import engines.capacity  # noqa: F401
    except ImportError:
        assert code == 2 and "--kv-bytes-per-token instead" in out
        return
    assert code == 0, out
    assert json.loads(out)["transfer"]["kv_bytes_per_token"] == 32 * 8 * 128 * 2  # layers x KV heads x dim x K,V; FP8
    code, out = _run(str(trace), "--no-progress", "--no-curve", "--model", "no-such-model")
    assert code == 2 and "--model" in out


def test_option_help_is_literal_and_names_every_accepted_kv_dtype(tmp_path: Path) -> None:
    import typer

    command = typer.main.get_command(create_cli()).commands["analyze"]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params}
    assert "%%" not in params["gpu"].help and "% of distinct" in params["gpu"].help
    assert "fp32" in params["kv_dtype"].help
    trace = _write(tmp_path / "tiny.jsonl", TINY)  # and fp32 is indeed accepted: 4 bytes per value
    code, out = _run(str(trace), "--json", "--no-progress", "--no-curve", "--model", "llama-3.1-8b", "--kv-dtype", "fp32")
    assert code == 0, out
    assert json.loads(out)["transfer"]["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 4


def test_huge_gpu_capacity_is_refused(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    code, out = _run(str(trace), "--no-progress", "--gpu", "99999999999")
    assert code == 2 and "--gpu" in out and "already holds everything" in out, out


def test_plots_path_is_checked_before_the_analysis(tmp_path: Path) -> None:
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for plots, needle in ((a_file, "is not a directory"), (a_file / "sub", "not a writable directory"),
                          (Path("/proc/kvgate-plots"), "not a writable directory")):
        res = CliRunner().invoke(create_cli(), ["analyze", str(trace), "--no-progress", "--plots", str(plots)])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (plots, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --plots") and needle in lines[0], res.stderr


def test_a_host_tier_past_what_the_trace_can_fill_is_capped_not_allocated(tmp_path: Path) -> None:
    """A host multiple of 1e300 used to allocate its tier (the OOM killer); past 16 x the trace's
    distinct blocks every block fits, so the point is replayed at that cap, with the same hit rate."""
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    code, out = _run(str(trace), "--json", "--no-progress", "--gpu", "1", "--host-multiples", "0,1e300")
    assert code == 0, out
    points = json.loads(out)["host_curve"]["points"]
    assert [p["host_blocks"] for p in points] == [0, 16 * 7]  # the tiny trace's 7 distinct blocks
    assert points[1]["hit_rate"] >= points[0]["hit_rate"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--host-link-gb-s", "1e308"], "--host-link-gb-s must be > 0 and a finite number"),
    (["--kv-bytes-per-token", "1e308"], "overflows (not a finite number): --kv-bytes-per-token 1e+308 is too large"),
])
def test_figures_that_overflow_are_refused_not_printed_as_infinity(tmp_path: Path, args: list[str], needle: str) -> None:
    """JSON has no Infinity or NaN: a product of huge options is an error (exit 2), in --json and tables alike."""
    trace = _write(tmp_path / "tiny.jsonl", TINY)
    for output in (["--json"], []):
        res = CliRunner().invoke(create_cli(), ["analyze", str(trace), "--no-progress", "--no-curve", *args, *output])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        lines = res.stderr.strip().splitlines()
        assert res.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
