"""Round-robin vs kv-aware routing, with and without prompt_cache_key, over three reference engines.

Three ``kvgate engine serve`` processes (one torch thread each, small KV pools) are the
replicas of one pool; one gateway (``kvgate serve``'s app, uvicorn in this process)
routes a multi-tenant chat workload over them. Rounds alternate the configurations
(``round-robin``, ``kv-aware``, ``kv-aware + key``, ``round-robin``, ...) in the same run; a
``+ key`` configuration sends every request with ``prompt_cache_key`` = its conversation
(requests sharing a key before they share a cached prefix: a conversation's first turn has
none), the others send none. Every round uses
fresh salted tenants replaying the same conversation texts, so no round inherits another's
cache hits and both routers face the same work and the same residue in the engines' pools.

Workload: ``--tenants`` tenants, each with its own system prompt and ``--conversations``
conversations of ``--turns`` turns (a long user message each; the model's greedy answer is
kept in the history), turns in order, conversations started in an order drawn with ``--seed``.
All conversations are open at once and at most
``--concurrency`` requests are in flight, so a replica sees other conversations between two
turns of one. Measured per router: cached-token share (``prompt_tokens_details.cached_tokens``
/ prompt tokens, from the engines' reuse), TTFT p50/p90 (first streamed content), requests
per replica (the gateway's ``kvgate_replica_requests_total``).

    python bench/routing/live.py [--rounds 2] [--seed 0] [--no-write]

Figures go to the ``bench:routing`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
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

from bench.report import machine, seed_line, write_section  # noqa: E402

MODEL = "smollm2-135m-instruct"
POOL = "bench"
TPB = 16
TOPICS = ["lighthouses", "orchards", "glaciers", "markets", "bridges", "libraries", "harbours", "railways"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engines(n: int, args, logs: Path) -> list[tuple[subprocess.Popen, int]]:
    import tritonclient.grpc as grpcclient

    env = dict(os.environ, OMP_NUM_THREADS="1", KVGATE_ENGINE_THREADS="1", PYTHONPATH=str(ROOT))
    engines = []
    for i in range(n):
        port = free_port()
        log = open(logs / f"engine{i}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "engine", "serve", "--port", str(port),
             "--tokens-per-block", str(TPB), "--primary-blocks", str(args.primary_blocks), "--secondary-blocks", "0",
             "--max-input-len", "1024", "--max-output-len", "64", "--max-batch-size", "8", "--max-num-tokens", "256"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        engines.append((proc, port))
    for proc, port in engines:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine on {port} exited; see {logs}")
            try:
                if client.is_model_ready("kvgate_llm"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine on {port} not ready")
            time.sleep(0.3)
    return engines


class GatewayThread:
    """The gateway app served by uvicorn on a loopback port, in a thread of this process."""

    def __init__(self, app, port: int) -> None:
        import threading

        import uvicorn

        self.app, self.port = app, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def seed(url: str, ports: list[int], primary_blocks: int):
    from tenants import migrate, pools, retention_classes
    from tenants.db import make_engine, make_session_factory

    migrate.upgrade(url=url)
    factory = make_session_factory(make_engine(url))
    now = datetime.now(UTC)
    with factory() as s:
        pools.create_pool(s, actor="bench", now=now, name=POOL, model_name=MODEL, engine_spec="reference-smollm2",
                          tokens_per_block=TPB, primary_blocks=primary_blocks, secondary_blocks=0,
                          secondary_offload_min_priority=30,
                          replicas=[{"name": f"r{i}", "endpoint": f"127.0.0.1:{p}"} for i, p in enumerate(ports)])
    # One priority for every segment (TensorRT-LLM's default 35): eviction is plain LRU, so a
    # round's blocks age out behind the next round's instead of outranking them (fresh salts
    # every round make them dead weight) — the comparison is about routing, not retention.
    with factory() as s:
        retention_classes.create_class(s, actor="bench", now=now, name="chat", system_priority=35,
                                       context_priority=35, turn_priority=35, decode_priority=35)
    return factory


def new_tenants(factory, pepper: str, prefix: str, count: int) -> list[str]:
    from tenants import keys, tenant

    out = []
    now = datetime.now(UTC)
    for i in range(count):
        slug = f"{prefix}-t{i}"
        with factory() as s:
            tenant.create_tenant(s, actor="bench", now=now, slug=slug, display_name=slug, pool=POOL,
                                 retention_class="chat", isolation="salted", rpm_limit=1_000_000,
                                 tpm_limit=1_000_000_000, max_concurrent_requests=1000)
        with factory() as s:
            out.append(keys.create_key(s, actor="bench", now=now, tenant=slug, pepper=pepper, name="bench")[1])
    return out


def system_prompt(tenant: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    return f"You are desk {tenant} of the {topic} society. Be brief and friendly."


def user_message(tenant: int, conversation: int, turn: int) -> str:
    topic = TOPICS[(tenant + conversation + turn) % len(TOPICS)]
    return (f"Visitor {conversation} of desk {tenant}, question {turn}: I am planning a long weekend around "
            f"{topic} with my family and two friends who walk slowly. We like quiet places, local food, "
            f"short walks and old buildings. What should we look at first, and what should we skip?")


async def conversation(http: httpx.AsyncClient, key: str, tenant: int, index: int, args, sink: list[dict],
                       slots: asyncio.Semaphore, keyed: bool) -> None:
    """One conversation, turn after turn; a slot is held per request (users think between turns).

    ``keyed``: every turn carries ``prompt_cache_key`` = the conversation (the gateway salts it with the tenant).
    """
    messages = [{"role": "system", "content": system_prompt(tenant)}]
    headers = {"Authorization": f"Bearer {key}"}
    for turn in range(args.turns):
        messages.append({"role": "user", "content": user_message(tenant, index, turn)})
        body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if keyed:
            body["prompt_cache_key"] = f"conversation-{tenant}-{index}"
        async with slots:
            answer = await one_turn(http, body, headers, sink)
        messages.append({"role": "assistant", "content": answer})


async def one_turn(http: httpx.AsyncClient, body: dict, headers: dict, sink: list[dict]) -> str:
    started = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(content)
    sink.append({"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]})
    return "".join(text)


def replica_requests(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("kvgate_replica_requests_total{") and 'status="ok"' in line:
            name = line.split('replica="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_round(http: httpx.AsyncClient, keys: list[str], args, keyed: bool) -> list[dict]:
    """Every conversation of every tenant at once (started in the seeded order); at most ``concurrency`` in flight."""
    import random

    sink: list[dict] = []
    slots = asyncio.Semaphore(args.concurrency)
    jobs = [(t, c) for c in range(args.conversations) for t in range(args.tenants)]
    random.Random(args.seed).shuffle(jobs)  # the same order in every round
    await asyncio.gather(*(conversation(http, keys[t], t, c, args, sink, slots, keyed) for t, c in jobs))
    return sink


async def measure(args, gateway, factory, pepper: str) -> dict[str, dict]:
    routing = gateway.app.state.gateway.routing
    http = httpx.AsyncClient(base_url=gateway.base_url, timeout=600,
                             limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))
    results: dict[str, dict] = {name: {"samples": [], "per_replica": {}, "seconds": 0.0}
                                for name in args.routers.split(",")}
    try:
        order = [name for _ in range(args.rounds) for name in args.routers.split(",")]
        for number, name in enumerate(order):
            router, keyed = name.removesuffix(KEYED), name.endswith(KEYED)
            routing.use_router(router)
            await asyncio.sleep(0.5)  # a poll or two: the fresh router's indexes resync from snapshots
            keys = new_tenants(factory, pepper, f"round{number}", args.tenants)
            before = replica_requests((await http.get("/metrics")).text)
            started = time.perf_counter()
            samples = await run_round(http, keys, args, keyed)
            elapsed = time.perf_counter() - started
            after = replica_requests((await http.get("/metrics")).text)
            entry = results[name]
            entry["samples"] += samples
            entry["seconds"] += elapsed
            for replica, count in after.items():
                entry["per_replica"][replica] = entry["per_replica"].get(replica, 0) + count - before.get(replica, 0)
            share = sum(s["cached"] for s in samples) / max(1, sum(s["prompt"] for s in samples))
            print(json.dumps({"round": number, "router": name, "requests": len(samples), "seconds": round(elapsed, 1),
                              "cached_share": round(share, 3)}), flush=True)
    finally:
        await http.aclose()
    return results


def summarise(results: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, entry in results.items():
        samples = entry["samples"]
        ttfts = [s["ttft"] for s in samples if s["ttft"] is not None]
        out[name] = {
            "requests": len(samples),
            "cached_share": sum(s["cached"] for s in samples) / max(1, sum(s["prompt"] for s in samples)),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 0.9),
            "per_replica": {k: int(v) for k, v in sorted(entry["per_replica"].items())},
            "seconds": entry["seconds"],
        }
    return out


KEYED = " + key"  # a configuration name ending in it sends prompt_cache_key
DEFAULT_ROUNDS, DEFAULT_REQUESTS = 2, 4 * 3 * 5  # the defaults below: rounds, tenants × conversations × turns
CONFIGS = "round-robin,kv-aware,kv-aware + key"


def render(summary: dict[str, dict], args) -> str:
    names = list(summary)
    rr = summary["round-robin"]
    lines = [
        "## Routing over replicas (`bench/routing/live.py`)",
        "",
        seed_line(args.seed, "the order conversations start in; prompt texts built from tenant, conversation and turn "
                             "numbers; greedy answers"),
        "",
        f"Machine: {machine()}. Three reference engines (`kvgate engine serve`, one torch thread each, "
        f"{args.primary_blocks} GPU blocks of {TPB} tokens, no host tier, one retention priority: LRU) are the replicas of one pool behind one "
        f"gateway. Workload: {args.tenants} salted tenants × {args.conversations} conversations × {args.turns} turns "
        f"(own system prompt per tenant, long user turns, greedy answers of ≤ {args.max_tokens} tokens kept in the "
        f"history), all conversations open at once with at most {args.concurrency} requests in flight (users think "
        f"between turns). {args.rounds} round(s) per configuration, alternated in one "
        "run, each round with fresh tenants (new salts) replaying the same texts. `+ key`: every request carries "
        "`prompt_cache_key` = its conversation (a conversation's first turn shares the key before it shares a "
        "cached prefix); without it no request carries a key.",
        "",
        "| configuration | requests | cached-token share | TTFT p50 s | TTFT p90 s | requests per replica | wall s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name in names:
        r = summary[name]
        per = ", ".join(f"{k} {v}" for k, v in r["per_replica"].items())
        lines.append(f"| {name} | {r['requests']} | {100 * r['cached_share']:.1f} % | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {per} | {r['seconds']:.0f} |")
    lines.append("")
    for name in names:
        if name == "round-robin":
            continue
        kv = summary[name]
        ratio = kv["cached_share"] / rr["cached_share"] if rr["cached_share"] else float("inf")
        lines.append(f"{name} / round-robin: cached-token share × {ratio:.2f}, TTFT p50 × "
                     f"{kv['ttft_p50_s'] / rr['ttft_p50_s']:.2f}, TTFT p90 × {kv['ttft_p90_s'] / rr['ttft_p90_s']:.2f}.")
        plain = summary.get(name.removesuffix(KEYED)) if name.endswith(KEYED) else None
        if plain is not None:
            lines.append(f"{name} / {name.removesuffix(KEYED)} (key on / off): cached-token share "
                         f"{100 * (kv['cached_share'] - plain['cached_share']):+.1f} points, TTFT p50 × "
                         f"{kv['ttft_p50_s'] / plain['ttft_p50_s']:.2f}, TTFT p90 × "
                         f"{kv['ttft_p90_s'] / plain['ttft_p90_s']:.2f}.")
        lines.append("")
    lines.append("The target: kv-aware's share ≥ 2× round-robin's and a lower TTFT p50, from the same run.")
    full = DEFAULT_ROUNDS * DEFAULT_REQUESTS
    if args.rounds * args.tenants * args.conversations * args.turns < full:
        lines += ["", f"**Reduced run**: {rr['requests']} requests per configuration instead of the default {full} "
                  f"(the machine was shared with other jobs), {args.rounds} round(s) each: too few to judge the target or to "
                  "read TTFT beyond its direction; the cached-token shares are exact counts of this run."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=3, help="per tenant")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--primary-blocks", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per router (alternated)")
    parser.add_argument("--routers", default=CONFIGS,
                        help=f"configurations alternated in each round (a router, '{KEYED.strip()}' suffix: send prompt_cache_key)")
    parser.add_argument("--seed", type=int, default=0, help="draws the order conversations start in")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if "round-robin" not in args.routers.split(","):
        args.no_write = True  # the docs section compares against round-robin

    from server.gateway.services import LoopIntervals
    from server.serving import build_serving_app
    from server.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-routing-"))
    engines = start_engines(args.replicas, args, tmp)
    gateway = None
    try:
        pepper = "bench-" + secrets.token_hex(16)
        url = f"sqlite:///{tmp / 'registry.db'}"
        factory = seed(url, [port for _, port in engines], args.primary_blocks)
        settings = Settings(database_url=url, admin_tokens=[f"bench:admin-{secrets.token_hex(8)}"], key_pepper=pepper)
        app = build_serving_app(settings, session_factory=factory, auth_ttl=5.0,
                                intervals=LoopIntervals(usage_flush=2.0, last_used_flush=10.0, pool_poll=0.2))
        gateway = GatewayThread(app, free_port())
        gateway.start()
        summary = summarise(asyncio.run(measure(args, gateway, factory, pepper)))
        print(json.dumps(summary, indent=1))
        if "round-robin" not in summary:
            return
        text = render(summary, args)
        print(text)
        if not args.no_write:
            write_section("routing", text)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc, _ in engines:
            proc.terminate()
        for proc, _ in engines:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
