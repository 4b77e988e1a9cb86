"""Live trace capture end to end: real engine, real gateway, admin API, export, simulate, analyze.

Two salted tenants send the same first prompt; one of them continues the conversation.
The capture must show the continuation's prefix reused (and the engine's cached tokens),
the other tenant's identical prompt under different ids, and no prompt text; the exported
file must feed ``kvgate simulate`` and ``kvgate analyze`` as it is.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from server.cli import create_cli
from tests.server.gateway.stack import Stack
from tests.server.gateway.test_openai_e2e import client, metric, system_prompt

A = "/admin/v1"


def _admin(stack: Stack, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, stack.gateway.base_url + A + path,
                         headers={"Authorization": f"Bearer {stack.admin_token}"}, timeout=30, **kwargs)


def _captures(stack: Stack):
    return stack.gateway.app.state.gateway.captures  # type: ignore[attr-defined]


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _lines(stack: Stack, capture_id: int) -> list[dict]:
    files = sorted((stack.trace_dir / "reference").glob(f"capture-{capture_id:06d}-*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _start(stack: Stack, **body) -> dict:
    r = _admin(stack, "POST", "/pools/reference/captures", json=body)
    assert r.status_code == 201, r.text
    cap = r.json()
    _wait(lambda: "reference" in _captures(stack).active_pools, "the gateway to pick up the capture")
    return cap


def _stop(stack: Stack, capture_id: int) -> None:
    assert _admin(stack, "POST", f"/pools/reference/captures/{capture_id}/stop").status_code == 200
    _wait(lambda: "reference" not in _captures(stack).active_pools, "the gateway to drop the capture")


def test_capture_round_trip_feeds_simulate_and_analyze(stack: Stack, tmp_path: Path) -> None:
    nonce = secrets.token_hex(3)
    a, b = f"cap-a-{nonce}", f"cap-b-{nonce}"
    ka, kb = stack.add_tenant(a, isolation="salted"), stack.add_tenant(b, isolation="salted")
    cap = _start(stack, sample_rate=1.0, max_bytes=10_000_000)
    started_ms = int(time.time() * 1000) - 1
    try:
        first = [{"role": "system", "content": system_prompt(nonce)},
                 {"role": "user", "content": "What is the capital of France?"}]
        ca, cb = client(stack, ka), client(stack, kb)
        r1 = ca.chat.completions.create(model="smollm2-135m-instruct", messages=first, max_tokens=4, temperature=0)
        cb.chat.completions.create(model="smollm2-135m-instruct", messages=first, max_tokens=4, temperature=0)
        second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                          {"role": "user", "content": "And of Italy?"}]
        stream = ca.chat.completions.create(model="smollm2-135m-instruct", messages=second, max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        lines = _wait(lambda: (got := _lines(stack, cap["id"])) and len(got) >= 3 and got, "three trace lines")
    finally:
        _stop(stack, cap["id"])
    ended_ms = int(time.time() * 1000) + 1

    assert len(lines) == 3
    la1, lb1, la2 = sorted(lines, key=lambda x: x["timestamp"])
    assert (la1["tenant"], lb1["tenant"], la2["tenant"]) == (a, b, a)
    tpb = stack.tokens_per_block
    for line in lines:
        assert line["block_size"] == tpb and line["retention_class"] == "standard" and line["status"] == "ok"
        assert len(line["hash_ids"]) == -(-line["input_length"] // tpb)
        assert all(0 <= h < 2**31 for h in line["hash_ids"])
        assert 0 < line["system_tokens"] <= line["context_tokens"] <= line["input_length"]
        assert line["output_length"] >= 1 and line["latency_ms"] > 0
    # salted: the same prompt from another tenant shares no id (and no cached token)
    assert la1["input_length"] == lb1["input_length"] and not set(la1["hash_ids"]) & set(lb1["hash_ids"])
    assert lb1["cached_gpu_tokens"] + lb1["cached_host_tokens"] == 0
    # the continuation reuses the first turn's full blocks, and the engine says so
    full = la1["input_length"] // tpb
    assert la2["hash_ids"][:full] == la1["hash_ids"][:full]
    assert la2["cached_gpu_tokens"] + la2["cached_host_tokens"] == usage.prompt_tokens_details.cached_tokens > 0
    assert la2["ttft_ms"] is not None and la2["ttft_ms"] > 0  # streamed: TTFT observed
    raw = "".join(p.read_text() for p in (stack.trace_dir / "reference").glob(f"capture-{cap['id']:06d}-*"))
    assert "geography" not in raw and "France" not in raw  # no prompt text (the nonce is in the tenant slugs)

    # export the time range, then simulate and analyze read it unchanged
    cli = CliRunner()
    out = tmp_path / "capture.jsonl"
    res = cli.invoke(create_cli(), ["trace", "export", "--pool", "reference", "--from", str(started_ms),
                                    "--to", str(ended_ms), "--capture", str(cap["id"]), "--dir", str(stack.trace_dir),
                                    "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert [json.loads(x) for x in out.read_text().splitlines()] == [la1, lb1, la2]

    res = cli.invoke(create_cli(), ["simulate", str(out), "-p", "lru", "-c", "64", "--host", "0", "--json",
                                    "--no-progress"])
    assert res.exit_code == 0, res.output
    sim = json.loads(res.output)
    assert (sim["requests"], sim["tokens_per_block"]) == (3, tpb)
    # a GPU that holds everything hits exactly the continuation's shared full blocks
    hit = sim["capacities"][0]["policies"]["lru"]["hit_rate"]
    total = la1["input_length"] + lb1["input_length"] + la2["input_length"]
    assert hit == full * tpb / total

    res = cli.invoke(create_cli(), ["analyze", str(out), "--json", "--no-progress", "--kv-bytes-per-token", "1000",
                                    "--gpu", "8", "--plots", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert (report["overview"]["requests"], report["overview"]["tenants"], report["overview"]["block_size"]) == (3, 2, tpb)
    per_tenant = {r["tenant"]: r for r in report["reuse"] if r["segment"] == "*"}
    assert per_tenant[a]["reused_tokens"] == full * tpb and per_tenant[b]["reused_tokens"] == 0
    observed = {r["tenant"]: r for r in report["observed"]}
    assert observed[a]["cached_gpu_tokens"] + observed[a]["cached_host_tokens"] == \
        la2["cached_gpu_tokens"] + la2["cached_host_tokens"]
    assert (tmp_path / "plots" / "reuse_gap_cdf.png").stat().st_size > 0


def test_capture_size_bound_and_tenant_filter(stack: Stack) -> None:
    nonce = secrets.token_hex(3)
    a, b = f"cap-c-{nonce}", f"cap-d-{nonce}"
    ka, kb = stack.add_tenant(a), stack.add_tenant(b)
    dropped = metric(stack, "kvgate_trace_lines_dropped_total", pool="reference", reason="size_bound")
    cap = _start(stack, max_bytes=100, tenant=b)  # smaller than one line
    try:
        messages = [{"role": "user", "content": f"[{nonce}] Name one colour."}]
        client(stack, ka).chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=2)
        client(stack, kb).chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=2)
        _wait(lambda: metric(stack, "kvgate_trace_lines_dropped_total", pool="reference", reason="size_bound")
              == dropped + 1, "the size-bound drop")
        assert metric(stack, "kvgate_trace_capture_full", pool="reference") == 1
        assert _lines(stack, cap["id"]) == []  # only b's request was offered (the filter), and it did not fit
    finally:
        _stop(stack, cap["id"])
