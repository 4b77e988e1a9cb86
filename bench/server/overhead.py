"""What the gateway costs: latency added over calling the engine directly, and CPU per request.

Side by side in one run, alternating rounds so machine noise hits both equally:

* **direct**: the engine model called with ``tritonclient.grpc.aio`` streaming (the
  gateway's own engine client, minus everything else);
* **gateway**: the same request as an OpenAI chat completion over HTTP through
  ``kvgate serve`` (auth, admission, chat template + tokenization, planning, gRPC,
  detokenization, SSE, metrics, usage).

The engine is ``bench/server/fixed_engine.py`` (a trivial model speaking the real contract that
returns 16 fixed tokens at once), each party in its own process; gateway CPU time is read
from ``/proc/<pid>/stat``. Figures go to the ``bench:gateway`` section of docs/benchmarks.md.

    python bench/server/overhead.py [--requests 400] [--no-write] [--structured | --messages | --sync]

``--structured`` measures only plain vs ``response_format`` json_schema requests side by
side (ratios) and writes ``bench:gateway_structured``, leaving ``bench:gateway`` alone.
``--messages`` measures the same prompt as an OpenAI chat completion and as an Anthropic
``/v1/messages`` request side by side (what the dialect adds on top of the one request
core) and writes ``bench:gateway_messages``.
``--sync [--redis URL]`` runs two gateways on the same engine, one plain and one with routing
sync (``KVGATE_ROUTING_SYNC``, both on Redis admission at ``URL``, each in its own namespace),
alternates rounds between them (CPU ratios sync / plain), measures in-process what applying a
peer's notices costs (``PeerLoads.apply`` on a ``KvAwareRouter``) and writes
``bench:gateway_sync``.

With `wrk` installed (Debian package `wrk`) it also measures saturation throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, publish, seed_line  # noqa: E402
from bench.server.gateway_load import (  # noqa: E402
    MESSAGES, cpu_seconds, free_port, pct, run_gateway, side_by_side, wait_http,
)
from engines.contract import EngineRequest, Guide, SamplingParams  # noqa: E402
from retention.types import RetentionPlan  # noqa: E402
from tenants import keys, migrate, pools, retention_classes, tenant  # noqa: E402
from tenants.db import make_engine, make_session_factory  # noqa: E402
from server.gateway.replicas.engine_client import EngineClient  # noqa: E402

def seed_registry(url: str, engine_port: int, pepper: str, *, pool: str = "fixed", model: str = "fixed",
                  primary_blocks: int = 1024) -> str:
    """A migrated registry with one pool on the engine at ``engine_port``, a default class and a
    tenant ``bench`` without practical limits; returns the tenant's API key."""
    migrate.upgrade(url=url)
    factory = make_session_factory(make_engine(url))
    now, actor = datetime.now(UTC), "bench"
    with factory() as s:
        pools.create_pool(s, actor=actor, now=now, name=pool, model_name=model,
                          replicas=[{"name": "r0", "endpoint": f"127.0.0.1:{engine_port}"}],
                          engine_spec="reference-smollm2", tokens_per_block=16, primary_blocks=primary_blocks,
                          secondary_blocks=0, secondary_offload_min_priority=35)
    with factory() as s:
        retention_classes.create_class(s, actor=actor, now=now, name="std")
    with factory() as s:
        tenant.create_tenant(s, actor=actor, now=now, slug="bench", display_name="Bench", pool=pool,
                             retention_class="std", rpm_limit=10_000_000, tpm_limit=2_000_000_000,
                             max_concurrent_requests=10_000, max_prompt_tokens=100_000, max_output_tokens=4096)
    with factory() as s:
        return keys.create_key(s, actor=actor, now=now, tenant="bench", pepper=pepper)[1]


async def run_direct(client: EngineClient, request: EngineRequest, n: int, concurrency: int) -> list[float]:
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            start = time.perf_counter()
            async for _ in client.generate(request, request_id=secrets.token_hex(4)):
                pass
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one() for _ in range(n)))
    return latencies


# A structured-output request: what the official SDK's parse(response_format=Model) sends.
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "Trip", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["destination", "days", "activities"],
    "properties": {"destination": {"type": "string"}, "days": {"type": "integer"},
                   "activities": {"type": "array", "items": {"type": "string"}}}}}}


async def measure(args, key: str, engine_port: int, gateway_port: int, gateway_pid: int,
                  modes: tuple = ((False, None), (True, None), (False, {"response_format": SCHEMA_FORMAT}))) -> list[dict]:
    from engines.tokenizer import load_gguf_tokenizer
    from server.gateway.api.prompting import prepare_chat

    prompt = prepare_chat(load_gguf_tokenizer(), MESSAGES)
    client = EngineClient(f"127.0.0.1:{engine_port}", "kvgate_llm")
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", limits=limits, timeout=60)
    rows = []
    schema_guide = Guide("json_schema", json.dumps(SCHEMA_FORMAT["json_schema"]["schema"], separators=(",", ":"), sort_keys=True))
    try:
        for stream, extra in modes:
            request = EngineRequest(prompt.input_ids, 16, 2, stream, SamplingParams(), RetentionPlan(), "salt", "1",
                                    guide=schema_guide if extra else None)
            await run_gateway(http, key, 40, 8, stream, extra)  # warm-up: tokenizer, caches, connections
            await run_direct(client, request, 40, 8)
            for concurrency in (1, 32):
                direct: list[float] = []
                gateway: list[float] = []
                cpu = 0.0
                rounds = 5
                per_round = max(1, args.requests // rounds)
                wall = 0.0
                for _ in range(rounds):
                    direct += await run_direct(client, request, per_round, concurrency)
                    before = cpu_seconds(gateway_pid)
                    started = time.perf_counter()
                    gateway += await run_gateway(http, key, per_round, concurrency, stream, extra)
                    wall += time.perf_counter() - started
                    cpu += cpu_seconds(gateway_pid) - before
                row = {
                    "mode": ("stream (16 chunks)" if stream else "non-stream") + (" + json_schema" if extra else ""),
                    "concurrency": concurrency,
                    "requests": len(gateway),
                    "direct_p50_ms": 1000 * pct(direct, 0.5), "direct_p99_ms": 1000 * pct(direct, 0.99),
                    "gateway_p50_ms": 1000 * pct(gateway, 0.5), "gateway_p99_ms": 1000 * pct(gateway, 0.99),
                    "added_p50_ms": 1000 * (pct(gateway, 0.5) - pct(direct, 0.5)),
                    "added_p99_ms": 1000 * (pct(gateway, 0.99) - pct(direct, 0.99)),
                    "gateway_cpu_ms_per_request": 1000 * cpu / len(gateway),
                    "gateway_requests_per_s": len(gateway) / wall,
                }
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    finally:
        await http.aclose()
        await client.close()
    return rows


async def measure_dialects(args, key: str, gateway_port: int, gateway_pid: int) -> list[dict]:
    """The same prompt as a chat completion and as a Messages request, alternating rounds:
    gateway latency and CPU per request of each, side by side."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", limits=limits, timeout=60)
    rows = []
    try:
        for stream in (False, True):
            for dialect in ("chat", "messages"):
                await run_gateway(http, key, 40, 8, stream, dialect=dialect)  # warm-up
            for concurrency in (1, 32):
                latencies: dict[str, list[float]] = {"chat": [], "messages": []}
                cpu = {"chat": 0.0, "messages": 0.0}
                rounds = 6
                per_round = max(1, args.requests // rounds)
                for i in range(rounds):
                    order = ("chat", "messages") if i % 2 == 0 else ("messages", "chat")
                    for dialect in order:
                        before = cpu_seconds(gateway_pid)
                        latencies[dialect] += await run_gateway(http, key, per_round, concurrency, stream,
                                                                dialect=dialect)
                        cpu[dialect] += cpu_seconds(gateway_pid) - before
                row = side_by_side(stream, concurrency, latencies, cpu)
                row["cpu_ratio"] = row["messages_cpu_ms_per_request"] / row["chat_cpu_ms_per_request"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    finally:
        await http.aclose()
    return rows


def render_messages(rows: list[dict]) -> str:
    """The ``bench:gateway_messages`` section: chat completion vs Anthropic Messages, one run."""
    lines = [
        "## Anthropic Messages vs chat completion: gateway cost (`bench/server/overhead.py --messages`)",
        "",
        f"Machine: {machine()} (shared; 1-minute load average {os.getloadavg()[0]:.1f} at the end). The same prompt "
        "(system + user, 16 output tokens from the fixed-token engine) as an OpenAI chat completion and as an "
        "Anthropic `/v1/messages` request through `kvgate serve`, alternating rounds (order flipped every round). Both "
        "run the one request core (auth, admission, template, tokenization, planning, gRPC, detokenization, metrics, "
        "usage); the Messages dialect adds its conversion and its own rendering (content blocks, usage split, named "
        "SSE events). Absolute figures drift with the machine's load; the ratio is the measurement.",
        "",
        "| mode | clients | chat p50 / p99 ms | messages p50 / p99 ms | chat CPU ms/req | messages CPU ms/req | "
        "messages / chat CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['chat_p50_ms']:.2f} / {r['chat_p99_ms']:.2f} | "
                     f"{r['messages_p50_ms']:.2f} / {r['messages_p99_ms']:.2f} | {r['chat_cpu_ms_per_request']:.2f} | "
                     f"{r['messages_cpu_ms_per_request']:.2f} | {r['cpu_ratio']:.2f} × |")
    lines += ["", "Target: a dialect costs no more than its rendering, i.e. within ~10 % of the chat completion's "
              "gateway CPU for the same prompt (the core is shared, so anything more is the dialect's own work)."]
    return "\n".join(lines)


def wrk_throughput(key: str, gateway_port: int, gateway_pid: int, stream: bool, seconds: int = 10) -> dict | None:
    """Saturation throughput with ``wrk`` (a C load generator, if installed): the Python
    load generator above tops out before the gateway does on 2 cores."""
    if shutil.which("wrk") is None:
        return None
    body = json.dumps({"model": "fixed", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": stream})
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    before = cpu_seconds(gateway_pid)
    out = subprocess.run(["wrk", "-t1", "-c32", f"-d{seconds}s", "-s", str(script),
                          f"http://127.0.0.1:{gateway_port}/v1/chat/completions"], capture_output=True, text=True).stdout
    cpu = cpu_seconds(gateway_pid) - before
    rps = float(out.split("Requests/sec:")[1].split()[0])
    total = int(out.split(" requests in ")[0].split()[-1])
    errors = "Non-2xx" in out or "Socket errors" in out
    row = {"mode": "stream (16 chunks)" if stream else "non-stream", "requests_per_s": rps,
           "gateway_cpu_ms_per_request": 1000 * cpu / max(1, total), "gateway_cores": cpu / seconds, "errors": errors}
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    return row


def grammar_costs(repeats: int = 200) -> dict:
    """The reference engine's side of a JSON-schema request, in-process: first compile of the
    schema, a cached lookup (what every later request with that schema pays), and one token
    step of the matcher (fill the bitmask + accept a token), medians in ms."""
    import torch

    from engines.reference import grammar
    from engines.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer()
    cache = grammar.GrammarCache(tokenizer, tokenizer.vocab_size)
    guide = Guide("json_schema", json.dumps(SCHEMA_FORMAT["json_schema"]["schema"]))
    cache.compile(Guide("json_schema", '{"type":"object"}'))  # tokenizer info and compiler set-up, not per schema
    start = time.perf_counter()
    compiled = cache.compile(guide)
    first = time.perf_counter() - start
    cached = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.compile(guide)
        cached.append(time.perf_counter() - start)
    # the grammar's separators are ", " and ": " (compile_json_schema(any_whitespace=False))
    text_ids = tokenizer.encode('{"destination": "Sintra", "days": 2, "activities": ["palace", "beach", "castle"]}')
    bitmask = grammar.token_bitmask(1, tokenizer.vocab_size)
    logits = torch.zeros(1, tokenizer.vocab_size)
    steps = []
    for _ in range(max(1, repeats // len(text_ids))):
        matcher = cache.matcher(compiled, tokenizer.eos_token_id)
        for token in text_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            grammar.apply_bitmask(logits, bitmask, [0])
            assert matcher.accept_token(token)
            steps.append(time.perf_counter() - start)
    return {"first_compile_ms": 1000 * first, "cached_compile_ms": 1000 * statistics.median(cached),
            "token_step_ms": 1000 * statistics.median(steps)}


def render(rows: list[dict], saturation: list[dict] | None = None, grammar_row: dict | None = None) -> str:
    lines = [
        "## Gateway overhead (`bench/server/overhead.py`)",
        "",
        seed_line(None, "one fixed chat request; the engine returns 16 fixed tokens"),
        "",
        f"Machine: {machine()}; load generator, gateway (1 uvicorn worker) and a fixed-token engine "
        "(`bench/server/fixed_engine.py`, 16 tokens) in separate processes on the same 2 cores. Direct = "
        "`tritonclient.grpc.aio` stream to the engine; gateway = OpenAI chat completion over HTTP through "
        "`kvgate serve` (auth, admission, template, tokenization, planning, gRPC, detokenization, metrics, usage). "
        "Rounds alternate direct/gateway; CPU from /proc.",
        "",
        "| mode | clients | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms | gateway CPU ms/req | gateway req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['direct_p50_ms']:.2f} / {r['direct_p99_ms']:.2f} | "
            f"{r['gateway_p50_ms']:.2f} / {r['gateway_p99_ms']:.2f} | {r['added_p50_ms']:.2f} / {r['added_p99_ms']:.2f} | "
            f"{r['gateway_cpu_ms_per_request']:.2f} | {r['gateway_requests_per_s']:.0f} |"
        )
    if saturation:
        lines += ["", "Saturation with `wrk -t1 -c32` (C load generator, 10 s; the gateway is one uvicorn worker, "
                  "so one core at most; the load generator and engine use the other):", "",
                  "| mode | gateway req/s | gateway CPU ms/req | gateway cores busy | errors |", "|---|---:|---:|---:|---|"]
        for r in saturation:
            lines.append(f"| {r['mode']} | {r['requests_per_s']:.0f} | {r['gateway_cpu_ms_per_request']:.2f} | "
                         f"{r['gateway_cores']:.2f} | {'yes' if r['errors'] else 'none'} |")
    if grammar_row:
        lines += ["", "Structured outputs: the `+ json_schema` rows send `response_format` json_schema (what "
                  "`client.beta.chat.completions.parse` sends); the gateway validates it and forwards the schema as the "
                  "engine's guide. The engine side (reference engine, xgrammar over SmolLM2's 49,152-token vocabulary), "
                  "medians in-process:", "",
                  "| first compile of the schema | cached lookup (every later request) | matcher per token (bitmask + accept) |",
                  "|---:|---:|---:|",
                  f"| {grammar_row['first_compile_ms']:.2f} ms | {grammar_row['cached_compile_ms']:.4f} ms | "
                  f"{grammar_row['token_step_ms']:.3f} ms |"]
    lines += ["", "Targets: ≤ 2 ms gateway CPU per non-streaming request, ≤ 5 ms per 16-token stream, "
              "≥ 300 non-streaming requests/s on 2 cores (LiteLLM 1.108.7, one worker, on this machine class: "
              "10.2 ms and 24.4 ms CPU, ~100 and ~36 requests/s)."]
    return "\n".join(lines)


def render_structured(rows: list[dict], grammar_row: dict) -> str:
    """The ``bench:gateway_structured`` section: plain vs json_schema requests side by side, one run."""
    plain = {r["concurrency"]: r for r in rows if "json_schema" not in r["mode"]}
    lines = [
        "## Structured outputs: gateway and engine cost (`bench/server/overhead.py --structured`)",
        "",
        seed_line(None, "fixed chat requests and schema; the engine returns fixed tokens"),
        "",
        f"Machine: {machine()} (shared; 1-minute load average {os.getloadavg()[0]:.1f} at the end). Non-streaming chat "
        "completions through `kvgate serve` to the fixed-token engine, alternating rounds, with and without "
        "`response_format` json_schema (what `client.beta.chat.completions.parse` sends: the gateway validates the "
        "schema and forwards it as the engine's guide). Absolute figures drift with the machine's load; the ratio "
        "is the measurement.",
        "",
        "| request | clients | gateway p50 / p99 ms | gateway CPU ms/req | CPU vs plain |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = plain[r["concurrency"]]["gateway_cpu_ms_per_request"]
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['gateway_p50_ms']:.2f} / {r['gateway_p99_ms']:.2f} | "
                     f"{r['gateway_cpu_ms_per_request']:.2f} | {r['gateway_cpu_ms_per_request'] / base:.2f} × |")
    lines += ["", "The engine side (reference engine, xgrammar over SmolLM2's 49,152-token vocabulary; compiled grammars "
              "are cached per schema), medians in-process:", "",
              "| first compile of the schema | cached lookup (every later request) | matcher per token (bitmask + accept) |",
              "|---:|---:|---:|",
              f"| {grammar_row['first_compile_ms']:.2f} ms | {grammar_row['cached_compile_ms']:.4f} ms | "
              f"{grammar_row['token_step_ms']:.3f} ms |"]
    return "\n".join(lines)


def start_gateway(env: dict, port: int, cwd: Path) -> subprocess.Popen:
    """``kvgate serve`` on ``port`` with the registry's pools (no engine of its own, no demo tenant)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo",
                             "--port", str(port)], env=env, cwd=cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="gateway requests per configuration")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--structured", action="store_true",
                        help="only plain vs json_schema requests (section bench:gateway_structured)")
    parser.add_argument("--messages", action="store_true",
                        help="only chat completion vs Anthropic /v1/messages (section bench:gateway_messages)")
    parser.add_argument("--sync", action="store_true",
                        help="only plain vs routing-sync gateway, and the cost of applying peers' notices "
                             "(section bench:gateway_sync)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", metavar="URL",
                        help="Redis for --sync (default %(default)s)")
    args = parser.parse_args()
    if args.sync:  # imported here: the sync's module builds on this one's helpers
        from bench.server.overhead_sync import apply_costs, redis_error, render_sync, sync_run
    if args.sync and (problem := redis_error(args.redis)):
        sys.exit(f"--sync needs a reachable Redis, and {args.redis} is not ({problem}); start one or pass --redis URL")
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    engine_port, gateway_port = free_port(), free_port()
    pepper, admin = "bench-pepper-" + secrets.token_hex(16), "bench-admin-" + secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    engine = subprocess.Popen([sys.executable, str(ROOT / "bench" / "server" / "fixed_engine.py"), "--port", str(engine_port)],
                              env=env, cwd=ROOT)
    db_url = f"sqlite:///{tmp / 'registry.db'}"
    key = seed_registry(db_url, engine_port, pepper)
    gw_env = dict(env, KVGATE_DATABASE_URL=db_url, KVGATE_KEY_PEPPER=pepper, KVGATE_ADMIN_TOKENS=f"bench:{admin}",
                  KVGATE_LOG_LEVEL="warning")
    namespace = "bench-" + secrets.token_hex(6)
    if args.sync:  # both on Redis admission, so the difference is the sync alone
        gw_env.update(KVGATE_REDIS_URL=args.redis, KVGATE_REDIS_NAMESPACE=f"{namespace}-plain")
    gateway = start_gateway(gw_env, gateway_port, tmp)
    gateways, ports = [gateway], [gateway_port]
    if args.sync:
        ports.append(free_port())
        gateways.append(start_gateway(dict(gw_env, KVGATE_ROUTING_SYNC="true", KVGATE_REDIS_NAMESPACE=namespace),
                                      ports[1], tmp / "sync"))
    try:
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/healthz")
        time.sleep(2.5)  # the fixed engine loads the tokenizer to pick its tokens
        if args.sync:
            published, rows = asyncio.run(sync_run(args, key, dict(zip(("plain", "sync"), ports)),
                                                   {"plain": gateway.pid, "sync": gateways[1].pid}, namespace))
            saturation = []
        elif args.messages:
            rows = asyncio.run(measure_dialects(args, key, gateway_port, gateway.pid))
            saturation = []
        elif args.structured:
            rows = asyncio.run(measure(args, key, engine_port, gateway_port, gateway.pid,
                                       modes=((False, None), (False, {"response_format": SCHEMA_FORMAT}))))
            saturation = []
        else:
            rows = asyncio.run(measure(args, key, engine_port, gateway_port, gateway.pid))
            saturation = [r for r in (wrk_throughput(key, gateway_port, gateway.pid, stream) for stream in (False, True)) if r]
    finally:
        for process in (*gateways, engine):
            process.terminate()
        for process in (*gateways, engine):
            process.wait(10)
    if args.sync:
        name, text = "gateway_sync", render_sync(rows, apply_costs(), published)
    elif args.messages:
        name, text = "gateway_messages", render_messages(rows)
    else:
        grammar_row = grammar_costs()
        print(json.dumps({k: round(v, 4) for k, v in grammar_row.items()}))
        name, text = (("gateway_structured", render_structured(rows, grammar_row)) if args.structured
                      else ("gateway", render(rows, saturation, grammar_row)))
    publish(name, text, write=not args.no_write)


if __name__ == "__main__":
    main()
