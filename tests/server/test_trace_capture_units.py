"""Trace capture pieces without an engine: ids, sampling, the block_size field, export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from retention.hashing import block_hashes
from retention.trace import TraceError, parse_trace, trace_block_size
from server.cli import create_cli
from server.cli.trace import parse_size, parse_time_ms
from server.gateway.observe.capture import sampled, trace_hash_ids, trace_id

KEY_A, KEY_B = b"a" * 32, b"b" * 32


def test_ids_follow_the_pools_hashes_in_31_bits_and_depend_on_key_and_salt() -> None:
    tokens = np.arange(70, dtype=np.int32)
    ids = trace_hash_ids(KEY_A, tokens, 16, "salt-1")
    assert len(ids) == 5 and all(0 <= i < 2**31 for i in ids)  # 4 full blocks + the 6-token tail
    assert ids[:4] == [trace_id(KEY_A, h) for h in block_hashes(tokens, 16, salt="salt-1")]
    assert trace_hash_ids(KEY_A, tokens[:64], 16, "salt-1") == ids[:4]  # a prefix keeps its ids
    longer = trace_hash_ids(KEY_A, np.arange(80, dtype=np.int32), 16, "salt-1")
    assert longer[:4] == ids[:4] and ids[4] != longer[4]  # a tail is not the full block it grows into
    assert not set(ids) & set(trace_hash_ids(KEY_A, tokens, 16, "salt-2"))  # salted tenants never match
    assert not set(ids) & set(trace_hash_ids(KEY_B, tokens, 16, "salt-1"))  # captures cannot be joined
    assert trace_hash_ids(KEY_A, tokens, 16, None) == trace_hash_ids(KEY_A, tokens, 16, None)  # shared: stable


def test_sampling_is_stable_per_conversation_and_near_the_rate() -> None:
    rng = np.random.default_rng(7)
    system = tuple(range(40))
    prompts = [system + tuple(int(t) for t in rng.integers(1000, 30000, 40)) for _ in range(2000)]
    picked = [sampled(KEY_A, "s", p, 40, 16, 0.25) for p in prompts]
    assert 0.21 < sum(picked) / len(picked) < 0.29
    # the next turn of the same conversation (same first non-system block) gets the same answer
    assert all(sampled(KEY_A, "s", p + (5, 6, 7) * 20, 40, 16, 0.25) == k for p, k in zip(prompts, picked, strict=True))
    assert all(sampled(KEY_A, "s", p, 40, 16, 1.0) for p in prompts[:10])


def test_parse_trace_reads_block_size_from_the_lines() -> None:
    def line(n: int, bs: int | None) -> str:
        obj = {"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": list(range(-(-n // (bs or 512))))}
        if bs is not None:
            obj["block_size"] = bs
        return json.dumps(obj)

    requests = parse_trace([line(40, 16), line(16, 16)])
    assert trace_block_size(requests) == 16 and [len(r.hash_ids) for r in requests] == [3, 1]
    assert trace_block_size(parse_trace([line(600, None)])) == 512  # Mooncake: no field, 512
    with pytest.raises(TraceError, match="differs"):
        parse_trace([line(40, 16), line(40, 8)])
    with pytest.raises(TraceError, match="others none"):
        parse_trace([line(40, 16), line(600, None)])
    with pytest.raises(TraceError, match="asked for is 32"):
        parse_trace([line(40, 16)], block_size=32)


def test_export_selects_a_time_range_in_order_and_skips_a_torn_line(tmp_path: Path) -> None:
    pool = tmp_path / "traces" / "p"
    pool.mkdir(parents=True)

    def obj(ts: int) -> dict:
        return {"timestamp": ts, "input_length": 4, "output_length": 1, "hash_ids": [ts], "block_size": 4}

    (pool / "capture-000001-h1-1.jsonl").write_text("".join(json.dumps(obj(t)) + "\n" for t in (100, 300, 500))
                                                    + '{"timestamp": 9')
    (pool / "capture-000001-h2-2.jsonl").write_text("".join(json.dumps(obj(t)) + "\n" for t in (200, 400)))
    (pool / "capture-000002-h1-1.jsonl").write_text(json.dumps(obj(250)) + "\n")
    out = tmp_path / "out.jsonl"
    cli = CliRunner()
    res = cli.invoke(create_cli(), ["trace", "export", "--pool", "p", "--dir", str(tmp_path / "traces"), "--capture",
                                    "1", "--from", "200", "--to", "500", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["timestamp"] for x in out.read_text().splitlines()] == [200, 300, 400]
    res = cli.invoke(create_cli(), ["trace", "export", "--pool", "p", "--dir", str(tmp_path / "traces"), "-o", str(out)])
    assert [json.loads(x)["timestamp"] for x in out.read_text().splitlines()] == [100, 200, 250, 300, 400, 500]
    for args, needle in ((["--pool", "none"], "no capture files"), (["--pool", "p", "--from", "tomorrow"], "--from"),
                         (["--pool", "p", "--from", "500", "--to", "100"], "after")):
        res = cli.invoke(create_cli(), ["trace", "export", "--dir", str(tmp_path / "traces"), "-o", str(out), *args])
        assert res.exit_code == 2 and needle in res.output, res.output


def test_sizes_and_times() -> None:
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1GB") == 10**9 and parse_size("1000") == 1000
    assert parse_time_ms("2026-12-01T00:00:00Z", field="--from") == 1796083200000
    assert parse_time_ms("2026-12-01T00:00:00", field="--from") == 1796083200000  # no zone: UTC
    assert parse_time_ms("1796083200000", field="--from") == 1796083200000


def test_trace_start_list_stop_from_the_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    cli, runner = create_cli(), CliRunner()

    def run(*args: str, code: int = 0) -> str:
        res = runner.invoke(cli, list(args))
        assert res.exit_code == code, (args, res.output)
        return res.output

    run("db", "upgrade")
    run("admin", "pools", "create", "gpu-a", "--set", "model_name=m", "--set", "triton_url=h:1",
        "--set", "primary_blocks=8")
    started = json.loads(run("trace", "start", "gpu-a", "--sample-rate", "0.5", "--max-bytes", "1MiB"))
    assert (started["sample_rate"], started["max_bytes"], started["state"]) == (0.5, 2**20, "active")
    assert "capture_active" in run("trace", "start", "gpu-a", code=1)
    assert "max_bytes" in run("trace", "start", "gpu-a", "--max-bytes", "lots", code=2)
    assert "sample_rate" in run("trace", "start", "gpu-a", "--sample-rate", "2", code=2)
    listed = json.loads(run("trace", "list", "gpu-a"))
    assert ([c["id"] for c in listed["items"]], listed["total"], listed["limit"], listed["offset"]) == (
        [started["id"]], 1, 50, 0)
    assert json.loads(run("trace", "list", "gpu-a", "--offset", "1"))["items"] == []
    assert "limit" in run("trace", "list", "gpu-a", "--limit", "0", code=2)
    assert json.loads(run("trace", "stop", "gpu-a", str(started["id"])))["state"] == "stopped"
    audit = json.loads(run("admin", "audit", "--entity-type", "trace_capture"))
    assert [e["action"] for e in audit["items"]] == ["trace_capture.stop", "trace_capture.create"]


def test_a_captured_line_carries_the_clients_hints_and_replays_them(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from retention.policy.hints import Breakpoint, CacheHints
    from retention.trace import parse_trace
    from server.gateway.observe.capture import TraceCaptures
    from tenants.captures import ActiveCapture

    captures = TraceCaptures(session_factory=None, directory=tmp_path, registry=CollectorRegistry())
    capture = ActiveCapture(id=7, pool="p", tenant_id=None, sample_rate=1.0, max_bytes=1 << 20, key=b"k" * 16)
    captures._active = {"p": capture}
    captures._sync({"p": capture})
    ids = tuple(range(1, 81))
    hints = CacheHints((Breakpoint(32, 3_600_000), Breakpoint(80, 300_000), Breakpoint(99, 300_000)),
                       cache_key="conversation-1", retention="24h")
    common = dict(tenant_id=1, tenant="acme", retention_class="chat", pool="p", tokens_per_block=16, salt="s",
                  input_ids=ids, system_end=32, context_end=64, output_length=3, reused_blocks=0, onboarded_blocks=0,
                  ttft=0.01, latency=0.1, status="ok")
    assert captures.offer(**common, hints=hints)
    assert captures.offer(**common)
    while not captures._queue.empty():
        kind, item = captures._queue.get_nowait()
        if kind == "line":
            captures._write(item)
    captures._close(captures._files[7])
    text = next((tmp_path / "p").glob("capture-000007-*.jsonl")).read_text()
    first, second = (json.loads(x) for x in text.splitlines())
    assert first["cache_breakpoints"] == [[32, 3_600_000], [80, 300_000]]  # the one past the prompt is not replayable
    assert first["prompt_cache_retention"] == "24h"
    assert "conversation-1" not in text  # the key is a client string: never written
    assert "cache_breakpoints" not in second and "prompt_cache_retention" not in second
    replayed = parse_trace(text.splitlines())
    assert replayed[0].hints == CacheHints((Breakpoint(32, 3_600_000), Breakpoint(80, 300_000)), retention="24h")


def _captures(directory: Path, *pools: str):  # noqa: ANN202
    """A capture service with ``pools`` active (capture ids 1, 2, …), its writer run in the test."""
    from prometheus_client import CollectorRegistry

    from server.gateway.observe.capture import TraceCaptures
    from tenants.captures import ActiveCapture

    tc = TraceCaptures(session_factory=None, directory=directory, registry=CollectorRegistry())
    tc._active = {pool: ActiveCapture(i, pool, None, 1.0, 1 << 30, KEY_A) for i, pool in enumerate(pools, 1)}
    tc._queue_control(tc._active)
    return tc


def _offer(tc, pool: str) -> bool:  # noqa: ANN001
    return tc.offer(tenant_id=1, tenant="acme", retention_class="chat", pool=pool, tokens_per_block=16, salt="s",
                    input_ids=tuple(range(100)), system_end=0, context_end=100, output_length=5, reused_blocks=0,
                    onboarded_blocks=0, ttft=0.01, latency=0.1, status="ok")


def _run_writer(tc) -> None:  # noqa: ANN001
    tc._queue.put(("stop", None))
    tc._run()  # the writer loop, in this thread: everything queued, then stop


def _count(tc, name: str, **labels: str) -> float:  # noqa: ANN001
    return tc.registry.get_sample_value(name, labels) or 0.0


def test_lines_an_unwritable_trace_directory_loses_are_counted_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "traces"
    blocker.write_text("not a directory")  # a wrong path or a read-only volume
    tc = _captures(blocker, "p")
    assert all(_offer(tc, "p") for _ in range(50))  # the requests never fail
    with caplog.at_level("WARNING", logger="kvgate.capture"):
        _run_writer(tc)
    assert _count(tc, "kvgate_trace_lines_total", pool="p") == 0
    assert _count(tc, "kvgate_trace_lines_dropped_total", pool="p", reason="write_error") == 50
    assert 1 <= len([r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]) <= 2


def test_one_pools_failing_directory_does_not_stop_the_other_pools_captures(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    d.mkdir()
    (d / "a").write_text("a file where pool a's directory should be")
    tc = _captures(d, "a", "b")
    assert _offer(tc, "b") and _offer(tc, "a")
    _run_writer(tc)
    files = list((d / "b").glob("*.jsonl"))
    assert len(files) == 1 and files[0].read_text().count("\n") == 1
    assert _count(tc, "kvgate_trace_lines_total", pool="b") == 1
    assert _count(tc, "kvgate_trace_lines_dropped_total", pool="a", reason="write_error") == 1


@pytest.fixture(scope="module")
def smollm():  # noqa: ANN201
    from engines.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer()


def _turns(tokenizer, system: str, first: str):  # noqa: ANN001, ANN202
    """Turn 1 (system, user, generation prompt) and turn 2 (…, assistant, user, generation prompt)."""
    from server.gateway.api.prompting import prepare_chat

    one = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    two = [*one, {"role": "assistant", "content": "Here is a long answer. " * 8}, {"role": "user", "content": "More?"}]
    return prepare_chat(tokenizer, one), prepare_chat(tokenizer, two)


def test_all_turns_of_a_conversation_share_the_sampling_key_its_first_message_sets(smollm) -> None:  # noqa: ANN001
    from server.gateway.observe.capture import sampling_end

    ends = smollm.stop_token_ids
    im_end = smollm.special_tokens["<|im_end|>"]
    system = "You are terse."
    # A first turn shorter than the first block after the system prompt: still one key for all turns.
    one, two = _turns(smollm, system, "Hi?")
    assert one.total < (one.system_end // 32 + 1) * 32
    cut = sampling_end(one.input_ids, one.system_end, 32, ends)
    assert cut == sampling_end(two.input_ids, two.system_end, 32, ends) and one.input_ids[cut - 1] == im_end
    assert one.input_ids[:cut] == two.input_ids[:cut] and cut > one.system_end
    # Same system prompt, different first messages: different keys, even when the first block after
    # the system prompt holds only the template's "<|im_start|>user\n".
    a, _ = _turns(smollm, system, "Tell me about cats, please.")
    b, _ = _turns(smollm, system, "Tell me about dogs, please.")
    end_a, end_b = (sampling_end(p.input_ids, p.system_end, 16, ends) for p in (a, b))
    assert a.input_ids[:end_a] != b.input_ids[:end_b]
    # A client's own "<|im_end|>" is plain text: it never ends the key early.
    c, _ = _turns(smollm, system, "a <|im_end|> then cats")
    d, _ = _turns(smollm, system, "a <|im_end|> then dogs")
    assert c.input_ids[:sampling_end(c.input_ids, c.system_end, 16, ends)] != \
        d.input_ids[:sampling_end(d.input_ids, d.system_end, 16, ends)]
    # No end-of-turn token given (a raw prompt): the first block after the system prompt, as before.
    assert sampling_end(one.input_ids, one.system_end, 16, ()) == min(one.total, (one.system_end // 16 + 1) * 16)


def test_sampling_decides_per_conversation_with_the_real_chat_template(smollm) -> None:  # noqa: ANN001
    ends, block = smollm.stop_token_ids, 16
    # A system prompt that ends 3 tokens before a block boundary: the first block after it holds
    # only "<|im_start|>user\n", which every conversation with this system prompt shares.
    system = next(s for s in ("word " * n for n in range(1, 64))
                  if _turns(smollm, s, "x")[0].system_end % block == block - 3)
    first, _ = _turns(smollm, system, "x")
    assert smollm.decode(first.input_ids[first.system_end:first.system_end + 3], skip_special_tokens=False) == \
        "<|im_start|>user\n"
    decisions = []
    for i in range(120):
        one, two = _turns(smollm, system, f"question number {i}: what is {i * 7}?")
        d1 = sampled(KEY_A, "s", one.input_ids, one.system_end, block, 0.5, ends)
        assert d1 == sampled(KEY_A, "s", two.input_ids, two.system_end, block, 0.5, ends)  # turns in or out together
        decisions.append(d1)
    assert 30 < sum(decisions) < 90  # conversations sharing the system prompt are sampled independently


def _line_file(directory: Path, pool: str, capture_id: int) -> Path:
    import os
    import socket

    return directory / pool / f"capture-{capture_id:06d}-{socket.gethostname()}-{os.getpid()}.jsonl"


def test_a_file_reopened_with_a_torn_last_line_is_cut_back_to_its_last_whole_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _line_file(tmp_path, "p", 1)
    path.parent.mkdir(parents=True)
    whole = b'{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 4}\n'
    path.write_bytes(whole * 2 + b'{"timestamp": 2, "input_len')  # the process died mid-line
    tc = _captures(tmp_path, "p")
    assert _offer(tc, "p")
    with caplog.at_level("WARNING", logger="kvgate.capture"):
        _run_writer(tc)
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    assert [json.loads(x)["input_length"] for x in lines[:-1]] == [4, 4, 100]  # the new line stands alone
    assert any("torn line" in r.getMessage() for r in caplog.records)
    assert _count(tc, "kvgate_trace_capture_bytes", pool="p") == path.stat().st_size


class _FullDisk:
    """A file handle whose ``fail_at``-th write writes half its data, then fails as a full disk does."""

    def __init__(self, raw, fail_at: int, truncate_fails: bool = False) -> None:  # noqa: ANN001
        self.raw, self.fail_at, self.truncate_fails, self.writes = raw, fail_at, truncate_fails, 0

    def write(self, data) -> int:  # noqa: ANN001
        self.writes += 1
        if self.writes == self.fail_at:
            data = bytes(data)
            self.raw.write(data[: len(data) // 2])
            if hasattr(self.raw, "flush"):
                self.raw.flush()
            raise OSError(28, "No space left on device")
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()

    def truncate(self, size: int) -> int:
        if self.truncate_fails:
            raise OSError(28, "No space left on device")
        return self.raw.truncate(size)

    def close(self) -> None:
        self.raw.close()


@pytest.mark.parametrize("truncate_fails", [False, True])
def test_a_write_that_fails_part_way_leaves_only_whole_lines(tmp_path: Path, truncate_fails: bool) -> None:
    tc = _captures(tmp_path, "p")
    tc._sync(tc._active)
    f = tc._files[1]
    f.handle = _FullDisk(f.handle, fail_at=2, truncate_fails=truncate_fails)
    assert all(_offer(tc, "p") for _ in range(3))
    _run_writer(tc)
    path = _line_file(tmp_path, "p", 1)
    text = path.read_bytes()
    assert text.endswith(b"\n") and [json.loads(x)["input_length"] for x in text.splitlines()] == [100, 100]
    assert _count(tc, "kvgate_trace_lines_dropped_total", pool="p", reason="write_error") == 1
    assert _count(tc, "kvgate_trace_lines_total", pool="p") == 2
    assert _count(tc, "kvgate_trace_capture_bytes", pool="p") == len(text)


def test_a_long_first_message_is_keyed_on_its_first_tokens_only() -> None:
    """The event loop never scans or hashes a long document for a sampling decision: a first
    message longer than SAMPLING_KEY_TOKENS is cut there, in every turn alike."""
    from server.gateway.observe.capture import SAMPLING_KEY_TOKENS, sampling_end

    end_of_turn = 2
    system = tuple(range(100, 140))
    document = tuple(7 for _ in range(5 * SAMPLING_KEY_TOKENS))
    turn1 = system + document + (end_of_turn, 9, 9)
    turn2 = turn1 + (11, 12, end_of_turn, 13)
    cuts = {sampling_end(t, len(system), 16, (end_of_turn,)) for t in (turn1, turn2)}
    assert cuts == {len(system) + SAMPLING_KEY_TOKENS}
    short = system + (5, 6, end_of_turn, 9)  # a short first message still ends at its end-of-turn token
    assert sampling_end(short, len(system), 16, (end_of_turn,)) == len(system) + 3
