"""Load: many concurrent streaming requests from several tenants through ``kvgate serve``.

The whole path is real: the CPU reference engine (``kvgate engine serve``), a counting
KServe proxy in front of it (``tests/reliability/proxies.py``: in-flight requests per
``tenant_id``, as the engine sees them), ``kvgate serve`` in its own process (RSS read
from /proc), a SQLite registry, and HTTP clients reading the SSE bytes.

Every tenant has a concurrency limit below its share of the burst, so the limits are
under contention: a request refused with 429 ``max_concurrent`` is retried after a
jittered pause (as a well-behaved client does) and counted as a refusal, not an error.
Each stream must arrive complete (one finish reason, usage, ``[DONE]``) with exactly
the text the same prompt produced alone before the burst (greedy decoding).

    python bench/reliability/load.py [--requests 200] [--tenants 4] [--max-tokens 4] [--no-write]

Figures go to the ``bench:load`` section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, seed_line, write_section  # noqa: E402
from engines.tokenizer import load_gguf_tokenizer  # noqa: E402
from server.gateway.api.prompting import prepare_chat  # noqa: E402
from tests.reliability.harness import GatewayProcess, Registry  # noqa: E402
from tests.reliability.proxies import start_counting_proxy  # noqa: E402
from tests.reliability.sse import SseParser, StreamResult, chat_body  # noqa: E402
from tests.server.gateway.stack import PEPPER, EngineProcess, free_port  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
ENGINE_ARGS = ["--tokens-per-block", "16", "--primary-blocks", "512", "--secondary-blocks", "512",
               "--max-input-len", "1024", "--max-output-len", "128", "--max-batch-size", "16",
               "--max-num-tokens", "512"]
QUESTIONS = ["Name one primary colour.", "What is two plus two?", "Say hello politely."]
LIMITS = (6, 10, 14, 20)


@dataclass
class LoadReport:
    requests: int
    tenants: int
    max_tokens: int
    replicas: int = 1
    admission: str = "local"
    seed: int = 8  # random.Random: each request's question and the clients' pauses
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    wrong_text: int = 0  # streams whose text is not what the engine generated for them
    differs_from_solo: int = 0  # engine numerics: batched greedy decoding flipped a near-tie
    mismatches: list[str] = field(default_factory=list)
    incomplete: int = 0
    refusals_429: int = 0
    retried_5xx: int = 0  # 503/504 answers carrying Retry-After (engine busy past its deadline), retried
    limits: dict[str, int] = field(default_factory=dict)
    engine_max_in_flight: dict[str, int] = field(default_factory=dict)
    engine_requests: dict[str, int] = field(default_factory=dict)
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    wall_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["errors"] = self.errors[:10]
        out["error_count"] = len(self.errors)
        return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _messages(tenant: int, question: int) -> list[dict]:
    return [{"role": "system", "content": f"You are assistant number {tenant} of a small shop. Be brief."},
            {"role": "user", "content": QUESTIONS[question % len(QUESTIONS)]}]


async def _stream(http: httpx.AsyncClient, url: str, key: str, body: dict, report: LoadReport, rng: random.Random,
                  ttfts: list[float], latencies: list[float]) -> StreamResult:
    while True:
        started = time.perf_counter()
        result = StreamResult(0)
        parser = SseParser(result)
        first = None
        async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            result.status = response.status_code
            if response.status_code == 429:
                error = json.loads(await response.aread())["error"]
                if error.get("param") != "max_concurrent":
                    report.errors.append(f"429 {error}")
                    return result
                report.refusals_429 += 1
                await asyncio.sleep(rng.uniform(0.3, 1.2))
                continue
            if response.status_code in (503, 504) and response.headers.get("retry-after") \
                    and report.retried_5xx < 10 * report.requests:
                # A well-behaved client waits Retry-After (stretched by up to 100 %) and retries.
                report.retried_5xx += 1
                await response.aread()
                await asyncio.sleep(float(response.headers["retry-after"]) * rng.uniform(1.0, 2.0))
                continue
            if response.status_code != 200:
                report.errors.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                return result
            async for line in response.aiter_lines():
                parser.line(line)
                if first is None and result.text:
                    first = time.perf_counter() - started
        latencies.append(time.perf_counter() - started)
        if first is not None:
            ttfts.append(first)
        return result


async def run_load(*, engine_port: int, workdir: Path, requests: int = 200, tenants: int = 4, max_tokens: int = 4,
                   limits: tuple[int, ...] = LIMITS, seed: int = 8, replicas: int = 1,
                   redis_url: str | None = None) -> LoadReport:
    """One burst of ``requests`` concurrent streams, spread evenly over ``tenants``.

    With ``replicas`` > 1 the clients alternate between that many ``kvgate serve``
    processes, which then need ``redis_url`` to share the tenants' limits.
    """
    server, proxy, proxy_port = await start_counting_proxy(f"127.0.0.1:{engine_port}")
    registry = Registry(f"sqlite:///{workdir / 'load.db'}", pepper=PEPPER)
    registry.add_pool("reference", f"127.0.0.1:{proxy_port}")
    registry.add_class()
    keys, slugs = [], []
    report = LoadReport(requests, tenants, max_tokens)
    run = secrets.token_hex(2)  # fresh slugs: Redis admission state is keyed by slug
    for t in range(tenants):
        slug = f"load-{t}-{run}"
        limit = limits[t % len(limits)]
        keys.append(registry.add_tenant(slug, pool="reference", isolation="salted", max_concurrent_requests=limit,
                                        rpm_limit=100_000, tpm_limit=10_000_000))
        slugs.append(slug)
        report.limits[slug] = limit
    env = {"KVGATE_REDIS_URL": redis_url} if redis_url else {}
    gateways = [GatewayProcess(registry.url, PEPPER, workdir / f"gateway{i}", extra_env=env) for i in range(replicas)]
    report.replicas = replicas
    report.admission = "redis" if redis_url else "local"
    report.seed = seed
    rng = random.Random(seed)
    try:
        for gateway in gateways:
            await asyncio.to_thread(gateway.start)
            await asyncio.to_thread(gateway.wait_ready)
        gateway = gateways[0]
        connections = httpx.Limits(max_connections=requests + 16, max_keepalive_connections=requests + 16)
        async with httpx.AsyncClient(base_url=gateway.base_url, limits=connections,
                                     timeout=httpx.Timeout(600.0)) as http:
            # Reference answers, each prompt alone (and warm: the burst will hit the cache too).
            expected: dict[tuple[int, int], tuple[str, int]] = {}
            for t in range(tenants):
                for q in range(len(QUESTIONS)):
                    for _ in range(2):
                        reply = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {keys[t]}"},
                                                json=chat_body(_messages(t, q), max_tokens=max_tokens, stream=False))
                        reply.raise_for_status()
                    body = reply.json()
                    expected[(t, q)] = (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"])
            report.rss_before_mib = sum(g.rss_bytes() for g in gateways) / 2**20
            baseline = {k: v for k, v in proxy.started.items()}
            len_before = len(proxy.calls)
            proxy.max_in_flight.clear()
            plan = [(i % tenants, rng.randrange(len(QUESTIONS))) for i in range(requests)]
            ttfts: list[float] = []
            latencies: list[float] = []
            started = time.perf_counter()
            results = await asyncio.gather(*(
                _stream(http, gateways[i % replicas].base_url + "/v1/chat/completions", keys[t],
                        chat_body(_messages(t, q), max_tokens=max_tokens), report, rng, ttfts, latencies)
                for i, (t, q) in enumerate(plan)))
            report.wall_s = time.perf_counter() - started
            report.rss_after_mib = sum(g.rss_bytes() for g in gateways) / 2**20
        # What the engine generated for each burst call, as text, keyed like the clients' view.
        tokenizer = load_gguf_tokenizer()
        prompt_of = {}
        for t in range(tenants):
            for q in range(len(QUESTIONS)):
                prompt_of[prepare_chat(tokenizer, _messages(t, q)).input_ids] = (t, q)
        engine_side = Counter()
        for call in proxy.calls[len_before:]:
            t, q = prompt_of.get(call.input_ids, (-1, -1))
            engine_side[(t, q, tokenizer.decode(call.output_ids), len(call.output_ids))] += 1
        client_side = Counter()
        for (t, q), result in zip(plan, results, strict=True):
            if result.status != 200:
                continue
            if not result.complete:
                report.incomplete += 1
                continue
            client_side[(t, q, result.text, result.usage["completion_tokens"])] += 1
            report.completed += 1
            if (result.text, result.usage["completion_tokens"]) != expected[(t, q)]:
                report.differs_from_solo += 1
        # Every stream must carry exactly what the engine produced for it: same multiset of
        # (tenant, prompt, text, token count) on both sides, so nothing lost, doubled or mixed.
        report.wrong_text = sum((client_side - engine_side).values())
        report.mismatches = [f"client {k}" for k in (client_side - engine_side)][:4] + \
            [f"engine {k}" for k in (engine_side - client_side)][:4]
        by_id = {}
        with registry.factory() as session:
            from tenants.models import Tenant

            for tenant in session.query(Tenant).all():
                by_id[str(tenant.id)] = tenant.slug
        report.engine_max_in_flight = {by_id.get(k, k): v for k, v in proxy.max_in_flight.items()}
        report.engine_requests = {by_id.get(k, k): v - baseline.get(k, 0) for k, v in proxy.started.items()}
        report.ttft_p50_s, report.ttft_p99_s = _pct(ttfts, 0.5), _pct(ttfts, 0.99)
        report.latency_p50_s, report.latency_p99_s = _pct(latencies, 0.5), _pct(latencies, 0.99)
        return report
    finally:
        for gateway in gateways:
            await asyncio.to_thread(gateway.stop)
        await server.stop(0)


def render(report: LoadReport) -> str:
    r = report
    limits = ", ".join(f"{s}: limit {r.limits[s]}, engine max {r.engine_max_in_flight.get(s, 0)}, "
                       f"{r.engine_requests.get(s, 0)} engine requests" for s in sorted(r.limits))
    return "\n".join([
        "## Load (`bench/reliability/load.py`)",
        "",
        seed_line(r.seed, "`random.Random`: each request's question and the clients' pauses"),
        "",
        f"Machine: {machine()}, shared. {r.requests} concurrent streaming chat completions from {r.tenants} "
        f"tenants (salted), {r.max_tokens} output tokens each, through {r.replicas} `kvgate serve` process(es) "
        f"({r.admission} admission) to the CPU reference engine (batch 16) behind a counting KServe proxy.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| streams complete (one finish reason, usage, [DONE]) | {r.completed} / {r.requests} |",
        f"| errors (transport, 5xx, non-limit 4xx) | {len(r.errors)} |",
        f"| incomplete streams / text not what the engine generated | {r.incomplete} / {r.wrong_text} |",
        f"| streams whose greedy text differs from the prompt's solo run (engine batch numerics) | "
        f"{r.differs_from_solo} |",
        f"| 429 max_concurrent refusals (retried) | {r.refusals_429} |",
        f"| 503/504 with Retry-After (engine past its first-token deadline; retried) | {r.retried_5xx} |",
        f"| gateway RSS before / after the burst (all replicas) | {r.rss_before_mib:.1f} MiB / {r.rss_after_mib:.1f} MiB |",
        f"| burst wall time | {r.wall_s:.1f} s |",
        f"| TTFT p50 / p99 (incl. queueing at the limit) | {r.ttft_p50_s:.2f} s / {r.ttft_p99_s:.2f} s |",
        f"| stream latency p50 / p99 | {r.latency_p50_s:.2f} s / {r.latency_p99_s:.2f} s |",
        "",
        f"Concurrency at the engine, per tenant: {limits}.",
    ])


async def _main(args) -> LoadReport:
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-load-"))
    engine = EngineProcess(free_port(), ENGINE_ARGS, tmp / "engine.log")
    await asyncio.to_thread(engine.start)
    try:
        return await run_load(engine_port=engine.port, workdir=tmp, requests=args.requests, tenants=args.tenants,
                              max_tokens=args.max_tokens, replicas=args.replicas, redis_url=args.redis_url)
    finally:
        engine.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=1, help="kvgate serve processes (> 1 needs --redis-url)")
    parser.add_argument("--redis-url", default=None, help="shared admission, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/reliability.md alone")
    args = parser.parse_args()
    report = asyncio.run(_main(args))
    print(json.dumps(report.as_dict(), indent=1))
    print(render(report))
    if not args.no_write:
        write_section("load", render(report), path=DOC)
        print(f"wrote {DOC} section bench:load")


if __name__ == "__main__":
    main()
