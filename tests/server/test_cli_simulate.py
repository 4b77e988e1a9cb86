"""`kvgate simulate` end to end through the real CLI (small trace files written per test)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from server.cli import create_cli


def write_trace(path: Path) -> Path:
    lines = []
    for i in range(24):
        ids = [0, 1, 2, 100 + i] if i % 3 == 0 else [1000 + 10 * i + k for k in range(4)]
        lines.append({"timestamp": i * 10, "input_length": 16, "output_length": 2, "hash_ids": ids,
                      "tenant": "gold" if i % 3 == 0 else "noisy"})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_json_report_has_policies_tiers_tenants_and_belady(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    result = CliRunner().invoke(
        create_cli(),
        ["simulate", str(trace), "--block-size", "4", "-c", "5", "-c", "50%", "--host", "4x", "--json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["requests"] == 24 and doc["distinct_blocks"] == len({0, 1, 2} | set(range(100, 124, 3))) + 16 * 4
    first, second = doc["capacities"]
    assert first["primary_blocks"] == 5 and first["secondary_blocks"] == 20
    assert set(first["policies"]) == {"lru", "trtllm-default"}
    trt = first["policies"]["trtllm-default"]
    assert trt["host_hit_rate"] > 0 and trt["onboarded_blocks"] > 0
    assert set(trt["tenants"]) == {"gold", "noisy"}
    assert first["belady_gpu"]["hit_rate"] >= first["policies"]["lru"]["hit_rate"]
    for cap in (first, second):  # LRU is an age-based policy: under the ceiling, which Belady caps
        assert cap["policies"]["lru"]["hit_rate"] <= cap["age_ceiling_gpu"] <= cap["belady_gpu"]["hit_rate"]
    assert second["primary_blocks"] == round(doc["distinct_blocks"] / 2)
    assert all(cap["age_estimate_gpu"] == cap["age_ceiling_gpu"] for cap in (first, second))


def test_table_output_plot_and_class_policy(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    classes = tmp_path / "classes.yaml"
    classes.write_text(
        "offload_min_priority: 35\ndefault: bulk\n"
        "classes:\n"
        "  premium: {system: {priority: 90}, context: {priority: 90}, turn: {priority: 90}, decode: {priority: 35}}\n"
        "  bulk: {system: {priority: 0}, context: {priority: 0}, turn: {priority: 0}, decode: {priority: 0}}\n"
        "tenants: {gold: premium}\n"
        "quotas: {noisy: 0.5}\n"
    )
    png = tmp_path / "plot.png"
    result = CliRunner().invoke(
        create_cli(),
        ["simulate", str(trace), "--block-size", "4", "-c", "6", "-c", "10", "--classes", str(classes),
         "-p", "lru", "-p", "class", "-p", "adaptive", "--plot", str(png), "--no-progress", "--hold", "tokens"],
    )
    assert result.exit_code == 0, result.output
    assert "Belady (GPU only)" in result.output and "per tenant" in result.output
    assert "age-based estimate (GPU only)" in result.output and "ceiling" not in result.output
    assert all(name in result.output for name in ("lru", "class", "adaptive"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_exits_2_with_a_message(tmp_path: Path) -> None:
    runner = CliRunner()
    trace = write_trace(tmp_path / "t.jsonl")
    cases = [
        (["simulate", str(tmp_path / "missing.jsonl")], "trace file not found"),
        (["simulate", str(trace), "--block-size", "4", "-c", "0"], "must be >= 1"),
        (["simulate", str(trace), "--block-size", "4", "--host", "lots"], "--host"),
        (["simulate", str(trace), "--block-size", "4", "-p", "class"], "needs a class mapping"),
        (["simulate", str(trace), "--block-size", "4", "-p", "nope"], "unknown policy"),
        (["simulate", str(trace)], "expected 1 with block size 512"),
        (["simulate", str(trace), "--block-size", "4", "--hold", "forever"], "--hold"),
    ]
    for argv, message in cases:
        result = runner.invoke(create_cli(), argv)
        assert result.exit_code == 2, (argv, result.output)
        assert message in result.output, (argv, result.output)


def test_oracle_ceilings_run_through_the_cli_and_bad_oracle_names_exit_2(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    args = ["simulate", str(trace), "--block-size", "4", "-c", "6", "--host", "0", "--json",
            "-p", "lru", "-p", "oracle-reuse", "-p", "oracle-reuse-within-15s", "-p", "oracle-reuse-within-0.02s", "-p", "oracle-next-use",
            "-p", "oracle-popularity-15s"]
    result = CliRunner().invoke(create_cli(), args)
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)["capacities"]
    policies = report["policies"]
    assert set(policies) == {"lru", "oracle-reuse", "oracle-reuse-within-15s", "oracle-reuse-within-0.02s", "oracle-next-use",
                             "oracle-popularity-15s"}
    belady = report["belady_gpu"]["hit_rate"]
    # gold's shared prefix [0, 1, 2] returns every 30 ms among unique noisy prompts: knowing
    # the future keeps it, LRU (6 blocks, 4-block prompts) loses it to the noise.
    assert policies["lru"]["hit_rate"] == 0
    assert 0 < policies["oracle-reuse"]["hit_rate"] <= belady
    assert policies["oracle-reuse-within-15s"]["hit_rate"] == policies["oracle-reuse"]["hit_rate"]
    assert policies["oracle-reuse-within-0.02s"]["hit_rate"] == 0  # gold comes back after 30 ms, not 20
    # Gold is used again within 15 s and the noise never is: popularity keeps it like oracle-reuse.
    assert policies["oracle-popularity-15s"]["hit_rate"] == policies["oracle-reuse"]["hit_rate"]
    assert all(p["offloaded_blocks"] == 0 for p in policies.values())

    bad = CliRunner().invoke(create_cli(), ["simulate", str(trace), "-p", "oracle-reuse-within-soon"])
    assert bad.exit_code == 2 and "unknown oracle policy 'oracle-reuse-within-soon'" in bad.output
    bad = CliRunner().invoke(create_cli(), ["simulate", str(trace), "-p", "oracle-popularity-0s"])
    assert bad.exit_code == 2 and "oracle-popularity-<S>s" in bad.output


def test_replicas_compare_routers_against_the_ceiling(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    result = CliRunner().invoke(
        create_cli(),
        ["simulate", str(trace), "--block-size", "4", "-c", "8", "--host", "2x", "-p", "trtllm-default",
         "--replicas", "2", "--hold", "tokens", "--json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    (run,) = doc["runs"]
    assert doc["replicas"] == 2 and run["primary_blocks_per_replica"] == 8 and run["secondary_blocks_per_replica"] == 16
    assert run["ceiling"]["primary_blocks"] == 16 and run["ceiling"]["secondary_blocks"] == 32
    assert set(run["routers"]) == {"random", "round-robin", "session", "kv-aware", "kv-adaptive"}
    for name, r in run["routers"].items():
        assert sum(rep["requests"] for rep in r["replicas"]) == 24, name
        assert r["load_imbalance"] >= 1.0
    assert [rep["requests"] for rep in run["routers"]["round-robin"]["replicas"]] == [12, 12]
    assert run["routers"]["kv-aware"]["share_of_ceiling"] == run["routers"]["kv-aware"]["total"]["hit_rate"] / run["ceiling"]["hit_rate"]
    # the one pool of 2x capacity is a reference, not a bound: new names beside the kept ones
    assert run["reference"] == run["ceiling"]
    assert all(r["share_of_reference"] == r["share_of_ceiling"] for r in run["routers"].values())
    table = CliRunner().invoke(
        create_cli(),
        ["simulate", str(trace), "--block-size", "4", "-c", "8", "--replicas", "2", "--router", "kv-aware",
         "--index", "approximate", "--ttl", "60", "--no-progress"],
    )
    assert table.exit_code == 0, table.output
    assert "reference (one pool × 2 capacity)" in table.output and "of reference" in table.output
    assert "load imbalance" in table.output and "ceiling" not in table.output


def test_gateways_alone_or_synced(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "8", "-p", "lru", "--replicas", "2", "--hold", "tokens",
            "--router", "kv-aware", "--router", "round-robin"]
    runs = {}
    for name, extra in [("one", []), ("split", ["--gateways", "2"]), ("synced", ["--gateways", "2", "--sync-delay", "0"])]:
        result = CliRunner().invoke(create_cli(), [*base, *extra, "--json"])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.output)
    assert (runs["split"]["gateways"], runs["split"]["sync_delay_s"]) == (2, None)
    assert (runs["synced"]["gateways"], runs["synced"]["sync_delay_s"]) == (2, 0.0)
    # synced with no delay, two gateways route as one
    one, synced = (runs[k]["runs"][0]["routers"]["kv-aware"] for k in ("one", "synced"))
    assert [r["requests"] for r in synced["replicas"]] == [r["requests"] for r in one["replicas"]]
    assert synced["total"] == one["total"]
    table = CliRunner().invoke(create_cli(), [*base, "--gateways", "2", "--sync-delay", "0.05", "--no-progress"])
    assert table.exit_code == 0, table.output
    assert "2 gateways synced (0.05 s late)" in table.output


def test_replica_options_exit_2_on_bad_input(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "8", "--no-progress"]
    for extra, message in [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--router", "kv-aware"], "--router needs --replicas"),
        (["--replicas", "2", "--router", "nearest"], "is not one of"),
        (["--replicas", "2", "--index", "exact"], "--index must be"),
        (["--replicas", "2", "--index", "approximate", "--ttl", "0"], "--ttl must be"),
        (["--replicas", "2", "--ttl", "30"], "--ttl applies to --index approximate"),
        (["--replicas", "2", "--cost", "cheap"], "--cost must be"),
        (["--replicas", "2", "--temperature", "-1"], "--temperature must be"),
        (["--replicas", "2", "-p", "oracle-reuse"], "cannot run with --replicas"),
        (["--gateways", "2"], "--gateways and --sync-delay need --replicas"),
        (["--replicas", "2", "--gateways", "0"], "--gateways must be >= 1"),
        (["--replicas", "2", "--gateways", "2", "--sync-delay", "-1"], "--sync-delay must be"),
        (["--replicas", "2", "--sync-delay", "0.01"], "--sync-delay needs --gateways 2"),
    ]:
        result = CliRunner().invoke(create_cli(), base + extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output, (extra, result.output)


def test_hinted_lines_replay_with_plus_hints(tmp_path: Path) -> None:
    """gold's prefix is marked for 1 h: with hints it survives the noisy tenant's flood on a 5-block GPU."""
    lines = []
    for i in range(24):
        gold = i % 3 == 0
        ids = [0, 1, 2, 100 + i] if gold else [1000 + 10 * i + k for k in range(4)]
        line = {"timestamp": i * 10, "input_length": 16, "output_length": 2, "hash_ids": ids,
                "tenant": "gold" if gold else "noisy"}
        if gold:
            line["cache_breakpoints"] = [[12, 3_600_000]]
        lines.append(line)
    trace = tmp_path / "h.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = CliRunner().invoke(create_cli(), ["simulate", str(trace), "--block-size", "4", "-c", "5", "--host", "0",
                                               "-p", "lru", "-p", "lru+hints", "--json"])
    assert result.exit_code == 0, result.output
    policies = json.loads(result.output)["capacities"][0]["policies"]
    assert policies["lru+hints"]["tenants"]["gold"]["hit_rate"] > policies["lru"]["tenants"]["gold"]["hit_rate"]


def test_token_rates_must_be_finite_and_positive(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "8", "--hold", "tokens", "--no-progress"]
    for extra, message in [
        (["--prefill-tps", "nan"], "prefill token rate must be a finite number > 0"),
        (["--decode-tps", "nan"], "decode token rate must be a finite number > 0"),
        (["--prefill-tps", "inf"], "prefill token rate must be a finite number > 0"),
        (["--decode-tps", "0"], "decode token rate must be a finite number > 0"),
    ]:
        result = CliRunner().invoke(create_cli(), base + extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.stderr, (extra, result.output)


def test_zero_tokens_per_block_is_refused_not_read_as_unset(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    result = CliRunner().invoke(create_cli(), ["simulate", str(trace), "--block-size", "4", "--tokens-per-block", "0",
                                               "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "block sizes must be >= 1" in result.stderr


def test_progress_bar_goes_to_stderr_not_stdout(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "8", "-p", "lru"]
    for extra in ([], ["--replicas", "2", "--router", "random"]):
        # FORCE_COLOR makes rich treat the captured streams as a terminal, so the bar is drawn.
        result = CliRunner().invoke(create_cli(), base + extra, env={"FORCE_COLOR": "1"})
        assert result.exit_code == 0, (extra, result.output)
        assert "replaying" in result.stderr, extra
        assert "replaying" not in result.stdout, extra


def test_router_help_names_every_router_and_the_default() -> None:
    import typer

    from retention.routing import ROUTER_NAMES

    command = typer.main.get_command(create_cli()).commands["simulate"]  # type: ignore[attr-defined]
    (router,) = [p for p in command.params if p.name == "router"]
    assert all(name in router.help for name in ROUTER_NAMES)
    assert f"default all {['one', 'two', 'three', 'four', 'five', 'six'][len(ROUTER_NAMES) - 1]}" in router.help


def _one_error_line(result, needle: str) -> None:  # noqa: ANN001
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_capacities_and_replicas_far_beyond_the_trace_are_refused(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    distinct = len({0, 1, 2} | set(range(100, 124, 3))) + 16 * 4
    base = ["simulate", str(trace), "--block-size", "4", "--no-progress"]
    for extra, needle in ((["-c", "99999999999"], f"{distinct} distinct blocks"),
                          (["-c", str(16 * distinct + 1), "--host", "0"], "already holds everything"),
                          (["-c", "99999999%"], "already holds everything"),
                          (["-c", "5", "--host", "99999999999"], "--host"),
                          (["-c", "5", "--host", "1000000x"], "already holds everything"),
                          (["--replicas", "100000000"], "--replicas must be <= 1024")):
        _one_error_line(CliRunner().invoke(create_cli(), base + extra), needle)
    ok = CliRunner().invoke(create_cli(), base + ["-c", str(16 * distinct), "--host", "0", "--json"])
    assert ok.exit_code == 0, ok.output


def test_plot_path_is_checked_before_the_replay(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "6", "--no-progress"]
    for extra, needle in ((["--plot", str(tmp_path / "missing" / "x.png")], "does not exist"),
                          (["--plot", str(tmp_path / "x.txt")], "'.txt'"),
                          (["--plot", str(tmp_path)], "is a directory"),
                          (["--replicas", "2", "--plot", str(tmp_path / "x.png")], "--replicas")):
        _one_error_line(CliRunner().invoke(create_cli(), base + extra), needle)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.txt").exists()
    result = CliRunner().invoke(create_cli(), base + ["--plot", str(tmp_path / "curve")])
    assert result.exit_code == 0, result.output
    assert f"plot written to {tmp_path / 'curve.png'}" in result.output
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_class_mapping_fields_of_the_wrong_type_are_named(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    head = ("classes:\n"
            "  premium: {system: {priority: 90}, context: {priority: 90}, turn: {priority: 90}, decode: {priority: 35}}\n")
    for body, field in (("tenants: [a, b]\n", "tenants"), ("quotas: [a]\n", "quotas"),
                        ("prefix_groups: [1]\n", "prefix_groups"), ("default: [premium]\n", "default")):
        classes = tmp_path / "classes.yaml"
        classes.write_text(head + body)
        result = CliRunner().invoke(create_cli(), ["simulate", str(trace), "--block-size", "4", "--no-progress",
                                                   "--classes", str(classes)])
        _one_error_line(result, field)


def test_huge_shares_and_multiples_exit_2_without_a_traceback(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "--no-progress"]
    for extra, needle in ((["-c", "5", "--host", "1e308x"], "--host '1e308x' at GPU 5 blocks"),
                          (["-c", "5", "--host", "1e308x", "--replicas", "2", "--router", "round-robin"], "--host '1e308x'"),
                          (["-c", "1e308%"], "more than 1600%")):
        result = CliRunner().invoke(create_cli(), base + extra)
        _one_error_line(result, needle)
        assert len(result.stderr) < 300, result.stderr  # no 300-digit count


def test_distinct_blocks_are_counted_at_the_pool_block_size(tmp_path: Path) -> None:
    """Trace blocks of 4 tokens, 16-token prompts: gold shares ids [0, 1, 2] (8 requests), noisy are unique (16)."""
    trace = write_trace(tmp_path / "t.jsonl")
    for pool_block, distinct in ((4, 75), (8, 1 + 8 + 16 * 2), (2, 6 + 8 * 2 + 16 * 8), (16, 8 + 16), (3, 4 + 8 * 2 + 16 * 6)):
        result = CliRunner().invoke(create_cli(), ["simulate", str(trace), "--block-size", "4", "--tokens-per-block",
                                                   str(pool_block), "-c", "10%", "-p", "lru", "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output)
        assert doc["distinct_blocks"] == distinct, pool_block
        assert doc["capacities"][0]["primary_blocks"] == round(distinct / 10), pool_block
    table = CliRunner().invoke(create_cli(), ["simulate", str(trace), "--block-size", "4", "--tokens-per-block", "8",
                                              "-c", "41", "-p", "lru", "--no-progress"])
    assert table.exit_code == 0, table.output
    assert "41 distinct blocks" in table.output and "GPU 41 blocks (100.00% of distinct)" in table.output


def test_explicit_progress_keeps_the_bar_with_json(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "-c", "8", "-p", "lru", "--json"]
    for extra in ([], ["--replicas", "2", "--router", "random"]):
        shown = CliRunner().invoke(create_cli(), base + extra + ["--progress"], env={"FORCE_COLOR": "1"})
        assert shown.exit_code == 0, (extra, shown.output)
        assert "replaying" in shown.stderr, extra
        json.loads(shown.stdout)  # stdout stays the JSON document alone
        default = CliRunner().invoke(create_cli(), base + extra, env={"FORCE_COLOR": "1"})
        assert default.exit_code == 0 and "replaying" not in default.stderr, extra


def test_repeated_policies_and_capacities_are_refused(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base = ["simulate", str(trace), "--block-size", "4", "--no-progress"]
    for extra, needle in ((["-p", "lru", "-p", "lru"], "-p 'lru' is given twice"),
                          (["-c", "5", "-c", "5"], "-c '5' is given twice"),
                          (["-c", "40%", "-c", "30"], "-c '30' is the same 30 blocks as -c '40%'")):
        _one_error_line(CliRunner().invoke(create_cli(), base + extra), needle)
