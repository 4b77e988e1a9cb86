"""`kvgate plan` through the real CLI: JSON, table, the reverse host sizing, and exit 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import create_cli
from server.cli.plan import CliError, parse_bytes, parse_tokens


def run(*args: str):
    return CliRunner().invoke(create_cli(), ["plan", *args])


def test_json_plan_and_registration_for_a_bundled_shape() -> None:
    result = run("qwen2.5-72b", "--gpu", "h200", "--tp", "8", "--weights", "fp8", "--host-memory", "256GiB",
                 "--context", "8K", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    # the figures test_arithmetic derives by hand for this configuration
    assert doc["registration"] == {"tokens_per_block": 32, "primary_blocks": 188_224, "secondary_blocks": 52_428}
    assert doc["spec"]["kv_cache"]["host_cache_size_per_rank"] == 32 * 2**30  # per rank: 256 GiB over 8 ranks
    assert doc["host_bytes_per_replica"] == 256 * 2**30
    assert doc["concurrent_sequences"] == 735 and doc["attention"] == "gqa"


def test_table_names_both_host_units(tmp_path: Path) -> None:
    result = run("llama-3.1-8b", "--gpu", "l40s", "--host-cache-size", "16GiB")
    assert result.exit_code == 0, result.output
    assert "host_cache_size (per rank)" in result.output and "host memory per replica" in result.output
    assert '"primary_blocks"' in result.output and '"host_cache_size_per_rank": 17179869184' in result.output


def test_config_json_path_and_reverse_host_blocks(tmp_path: Path) -> None:
    config = tmp_path / "Llama-3.1-8B" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                                  "vocab_size": 128256}))
    result = run(str(config), "--gpu", "h100", "--host-blocks", "1000", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == "Llama-3.1-8B" and doc["secondary_blocks"] == 1000
    assert doc["host_cache_size"] == 1000 * 32 * 32 * 2 * 8 * 128  # blocks × tokens × FP8 KV bytes/token


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/config.json"], "cannot read config.json"),
    (["llama-3.1-70b", "--gpu", "h100", "--weights", "bf16"], "weights need"),
    (["llama-3.1-8b", "--gpu", "tpu"], "unknown GPU"),
    (["llama-3.1-8b", "--kv-dtype", "int3"], "unknown dtype"),
    (["llama-3.1-8b", "--context", "lots"], "--context"),
    (["llama-3.1-8b", "--host-memory", "1GiB", "--host-blocks", "3"], "at most one"),
    (["llama-3.1-8b", "--tp", "4", "--gpus", "6"], "multiple of tp"),
    ([], "give a MODEL"),
    (["llama-3.1-8b", "--reserve-gib", "nan"], "--reserve-gib must be a finite number"),
    (["llama-3.1-8b", "--reserve-gib", "1e300"], "--reserve-gib must be a finite number"),
    (["llama-3.1-8b", "--reserve-gib", "-1"], "--reserve-gib must be a finite number"),
])
def test_bad_input_exits_2_with_a_message(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_incomplete_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                                  "num_attention_heads": 128, "vocab_size": 129280, "kv_lora_rank": 512}))
    result = run(str(config))
    assert result.exit_code == 2
    assert "'qk_rope_head_dim'" in result.output


def test_list() -> None:
    result = run("--list")
    assert result.exit_code == 0 and "deepseek-v3" in result.output and "h200-141gb" in result.output


def test_size_parsers() -> None:
    assert parse_bytes("256GiB", "x") == 256 * 2**30 and parse_bytes("80GB", "x") == 80 * 10**9
    assert parse_bytes("1024", "x") == 1024
    assert parse_tokens("128K", "x") == 131072 and parse_tokens("8192", "x") == 8192
    with pytest.raises(CliError):
        parse_bytes("12 parsecs", "x")


def test_engine_spec_supplies_what_it_fixes() -> None:
    result = run("--spec", "llama-3.1-70b-instruct-fp8-tp8", "--gpu", "h200", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == "llama-3.1-70b" and doc["tensor_parallel"] == 8 and doc["tokens_per_block"] == 32
    assert (doc["kv_dtype"], doc["weight_dtype"], doc["free_gpu_memory_fraction"]) == ("fp8", "fp8", 0.9)
    # the spec's host_cache_size_per_rank (TensorRT-LLM's unit): 32 GiB × 8 ranks = 256 GiB on the node
    assert doc["host_cache_size"] == 32 * 2**30 and doc["host_bytes_per_replica"] == 256 * 2**30
    assert doc["secondary_blocks"] == (32 * 2**30 // (80 * 2 * 1 * 128)) // 32
    override = json.loads(run("--spec", "llama-3.1-70b-instruct-fp8-tp8", "--gpu", "h200", "--tp", "4",
                              "--host-memory", "64GiB", "--json").output)
    assert override["tensor_parallel"] == 4 and override["host_cache_size"] == 16 * 2**30


def test_spec_without_a_bundled_shape_or_unknown_spec_exits_2() -> None:
    result = run("--spec", "reference-smollm2")
    assert result.exit_code == 2 and "no bundled shape has the spec's model" in result.output
    result = run("--spec", "no-such-spec", "--gpu", "h200")
    assert result.exit_code == 2 and "no bundled spec" in result.output


def _merged(base: str, values: dict) -> dict:
    from engines.spec import load_bundled_spec

    data = load_bundled_spec(base).model_dump(mode="json", exclude_none=True)
    for section, fields in values.items():
        data[section].update(fields)
    return data


@pytest.mark.parametrize(("args", "base", "changed"), [
    (["llama-3.1-70b", "--gpu", "h200", "--tp", "8", "--kv-dtype", "fp8"], "llama-3.1-70b-instruct-fp8-tp8", False),
    (["llama-3.1-70b", "--gpu", "h200", "--tp", "8"], "llama-3.1-70b-instruct-fp8-tp8", False),  # defaults: fp8 + fp8
    (["llama-3.1-70b", "--gpu", "h200", "--tp", "8", "--weights", "bf16"], "llama-3.1-70b-instruct-fp8-tp8", True),
    (["llama-3.1-70b", "--gpu", "h100", "--tp", "8", "--kv-dtype", "fp16"], "llama-3.1-70b-instruct-fp8-tp8", True),
    (["llama-3.1-70b", "--gpu", "h200", "--tp", "8", "--weights", "fp8"], "llama-3.1-70b-instruct-fp8-tp8", False),
    (["llama-3.1-8b", "--gpu", "l40s", "--host-cache-size", "16GiB"], "llama-3.1-8b-instruct-fp8kv", False),
    (["llama-3.1-8b", "--gpu", "l40s", "--weights", "fp16"], "llama-3.1-8b-instruct-fp8kv", True),
    (["--spec", "llama-3.1-8b-instruct-fp8kv", "--gpu", "h100"], "llama-3.1-8b-instruct-fp8kv", False),
])
def test_every_spec_plan_prints_validates(args: list[str], base: str, changed: bool) -> None:
    """The validator (engines/spec.py) accepts the spec values of both outputs; a refused choice is named."""
    from engines.spec import parse_spec

    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    spec = parse_spec(_merged(base, doc["spec"]), source="kvgate plan --json")
    assert (spec.quantization.kv_cache, spec.quantization.weights) == ("fp8", "fp8")
    assert doc["spec_choice"]["changed"] is changed and (doc["spec_choice"]["reason"] is not None) is changed
    if "--kv-dtype" not in args or "fp8" in args[args.index("--kv-dtype") + 1]:
        if changed:
            assert "fp8-kv-needs-fp8-weights" in doc["spec_choice"]["reason"]
    table = run(*args)
    assert table.exit_code == 0, table.output
    [line] = [x for x in table.output.splitlines() if x.startswith("spec values: ")]
    parse_spec(_merged(base, json.loads(line.removeprefix("spec values: "))), source="kvgate plan")
    assert ("nearest valid choice: --kv-dtype fp8 --weights fp8" in table.output) is changed
    [registration] = [x for x in table.output.splitlines() if x.startswith("pool registration")]
    assert json.loads(registration.split(": ", 1)[1]) == doc["registration"]


def test_a_gpu_without_fp8_prints_no_spec() -> None:
    result = run("llama-3.1-8b", "--gpu", "a100", "--kv-dtype", "fp16", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["spec"] is None and doc["registration"] is None and "no FP8" in doc["spec_choice"]["reason"]
    table = run("llama-3.1-8b", "--gpu", "a100", "--kv-dtype", "fp16")
    assert "no engine spec:" in table.output and "spec values:" not in table.output


@pytest.mark.parametrize(("option", "message"), [
    ("--tp", "--tp and --pp must be >= 1"),
    ("--pp", "--tp and --pp must be >= 1"),
    ("--gpus", "must be a positive multiple of tp"),
    ("--tokens-per-block", "power of two"),
])
def test_zero_is_refused_not_read_as_unset(option: str, message: str) -> None:
    result = run("llama-3.1-8b", option, "0")
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.parametrize(("args", "message"), [
    (("--tokens-per-block", "2048"), "power of two within [2, 1024]"),
    (("--tp", "128", "--gpus", "128"), "--tp and --pp must be <= 64"),
    (("--pp", "65", "--gpus", "65"), "--tp and --pp must be <= 64"),
])
def test_values_no_engine_spec_accepts_are_refused(args: tuple[str, ...], message: str) -> None:
    """The plan prints spec values; its bounds are the spec's (engines/spec.py), one line, exit 2."""
    result = run("llama-3.1-8b", *args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_the_largest_values_a_spec_accepts_are_planned() -> None:
    from engines.spec import parse_spec

    result = run("llama-3.1-8b", "--tokens-per-block", "1024", "--tp", "64", "--gpus", "64", "--json")
    assert result.exit_code == 0, result.output
    spec = json.loads(result.output)["spec"]
    assert spec["build"]["tokens_per_block"] == 1024 and spec["build"]["tensor_parallel"] == 64
    parse_spec(_merged("llama-3.1-8b-instruct-fp8kv", spec), source="kvgate plan")


def test_the_defaults_plan_the_valid_fp8_pair_and_weights_follow_the_kv_dtype() -> None:
    result = run("llama-3.1-8b", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["kv_dtype"], doc["weight_dtype"]) == ("fp8", "fp8")
    assert doc["spec_choice"]["changed"] is False and doc["spec_choice"]["reason"] is None
    assert doc["registration"]["primary_blocks"] == doc["primary_blocks"]  # the table is the deployable engine
    table = run("llama-3.1-8b")
    assert table.exit_code == 0 and "note:" not in table.output and "nearest valid choice" not in table.output
    other = json.loads(run("llama-3.1-8b", "--kv-dtype", "fp16", "--json").output)
    assert (other["kv_dtype"], other["weight_dtype"]) == ("fp16", "bf16")


@pytest.mark.parametrize(("command", "shown"), [
    (["plan"], ["fp8 | fp16 | bf16 | fp32 [fp8]", "[fp8 with FP8"]),
    (["build", "download"], ["[default branch]"]),
])
def test_help_shows_bracketed_defaults(command: list[str], shown: list[str]) -> None:
    """Rich markup would read ``[fp8]`` as a style tag and drop it; the help escapes it."""
    result = CliRunner().invoke(create_cli(), [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert all(s in text for s in shown), text
