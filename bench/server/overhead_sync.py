"""The routing sync's gateway cost: ``bench/server/overhead.py --sync`` (section ``bench:gateway_sync``).

Two gateways on the same engine, one plain and one with routing sync (``KVGATE_ROUTING_SYNC``),
both on Redis admission, each in its own namespace; rounds alternate between them (CPU ratios
sync / plain). Before the rounds, the sync gateway is checked to publish one notice per hook and
request. Apart from the servers, what applying a peer's notices costs (``PeerLoads.apply`` on a
``KvAwareRouter``) is timed in-process. ``overhead.py`` starts the processes and calls
:func:`sync_run`, :func:`apply_costs` and :func:`render_sync`.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import Counter

import httpx

from bench.report import machine, seed_line
from bench.server.gateway_load import cpu_seconds, run_gateway, side_by_side

SYNC_ROUNDS = 8
SYNC_SEED = 0


def redis_error(url: str) -> str | None:
    """Why Redis at ``url`` cannot be used (None: it answers PING)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
        return None
    except (redis.RedisError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


async def published_notices(redis_url: str, namespace: str, http: httpx.AsyncClient, key: str, n: int = 10) -> dict:
    """Check that the sync gateway publishes: ``n`` non-streaming and ``n`` streaming requests,
    the notices seen on its channels by kind, and the size of a dispatch notice."""
    import redis.asyncio as redis_asyncio

    from retention.routing import Notice

    client = redis_asyncio.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    kinds: Counter[str] = Counter()
    dispatch_bytes = hashes = 0
    try:
        await pubsub.psubscribe(f"{namespace}:routing:*")
        for stream in (False, True):
            await run_gateway(http, key, n, 1, stream)
        deadline = time.monotonic() + 5
        while kinds["complete"] < 2 * n and time.monotonic() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message and message["type"] == "pmessage":
                notice = Notice.decode(message["data"])
                kinds[notice.kind] += 1
                if notice.kind == "dispatch":
                    dispatch_bytes, hashes = len(message["data"]), len(notice.hashes)
    finally:
        await pubsub.aclose()
        await client.aclose()
    seen = {"requests": 2 * n, "dispatch_bytes": dispatch_bytes, "hashes": hashes,
            **{kind: kinds[kind] for kind in ("dispatch", "first_token", "complete")}}
    print(json.dumps({"published": seen}))
    if not all(seen[kind] == 2 * n for kind in ("dispatch", "first_token", "complete")):
        raise RuntimeError(f"the sync gateway did not publish one notice per hook and request: {seen}")
    return seen


async def measure_sync(args, key: str, ports: dict[str, int], pids: dict[str, int]) -> list[dict]:
    """The same requests through the plain and the routing-sync gateway, alternating rounds
    (order flipped every round): latency, CPU per request of each gateway process, and the
    median over rounds of the per-round CPU ratio sync / plain."""
    # Each gateway's connections idle through the other's round: drop them before uvicorn's 5 s
    # keep-alive does (a request racing the server's close fails with ReadError).
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0)
    http = {name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60)
            for name, port in ports.items()}
    rows = []
    try:
        for stream in (False, True):
            for name in ("plain", "sync"):
                await run_gateway(http[name], key, 40, 8, stream)  # warm-up
            for concurrency in (1, 32):
                latencies: dict[str, list[float]] = {"plain": [], "sync": []}
                cpu = {"plain": 0.0, "sync": 0.0}
                ratios = []
                per_round = max(1, args.requests // SYNC_ROUNDS)
                for i in range(SYNC_ROUNDS):
                    order = ("plain", "sync") if i % 2 == 0 else ("sync", "plain")
                    spent = {}
                    for name in order:
                        before = cpu_seconds(pids[name])
                        latencies[name] += await run_gateway(http[name], key, per_round, concurrency, stream)
                        spent[name] = cpu_seconds(pids[name]) - before
                        cpu[name] += spent[name]
                    ratios.append(spent["sync"] / spent["plain"] if spent["plain"] else float("nan"))
                row = side_by_side(stream, concurrency, latencies, cpu)
                row["ratios"] = ratios
                row["cpu_ratio"] = statistics.median(ratios)
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else
                                  [round(x, 3) for x in v] if isinstance(v, list) else v for k, v in row.items()}))
    finally:
        for client in http.values():
            await client.aclose()
    return rows


def apply_costs(sizes: tuple[int, ...] = (8, 64, 256), notices: int = 2000, repeats: int = 9,
                replicas: int = 4, seed: int = SYNC_SEED) -> list[dict]:
    """In-process, no server: what a gateway pays for one peer request's notices. Per dispatch
    size (block hashes), ``repeats`` repetitions of ``notices`` peer requests (``seed``-drawn
    random 64-bit hashes, each request its own, spread over ``replicas`` replicas) applied with
    ``PeerLoads.apply`` to a ``KvAwareRouter`` (the gateway's default router): all dispatches,
    then all first tokens, then all completions; ``Notice.decode`` of the same notices timed
    apart. Medians over repetitions of µs per notice."""
    from retention.routing import KvAwareRouter, Notice, PeerLoads

    rng = random.Random(seed)
    peers = PeerLoads(KvAwareRouter(tokens_per_block=16), "self")
    rows = []
    for size in sizes:
        timings: dict[str, list[float]] = {}
        for rep in range(repeats):
            batch = {
                "dispatch": [Notice("peer", "dispatch", f"{size}-{rep}-{i}", i % replicas,
                                    tuple(rng.getrandbits(64) for _ in range(size)), 16 * size, 16, 0)
                             for i in range(notices)],
                "first_token": [Notice("peer", "first_token", f"{size}-{rep}-{i}") for i in range(notices)],
                "complete": [Notice("peer", "complete", f"{size}-{rep}-{i}") for i in range(notices)],
            }
            now = float(rep)
            for kind, items in batch.items():  # in this order: every request dispatched, started, done
                encoded = [notice.encode() for notice in items]
                start = time.perf_counter_ns()
                for data in encoded:
                    Notice.decode(data)
                decoded = time.perf_counter_ns()
                for notice in items:
                    peers.apply(notice, now=now)
                applied = time.perf_counter_ns()
                timings.setdefault(f"{kind}_decode_us", []).append((decoded - start) / 1000 / notices)
                timings.setdefault(f"{kind}_apply_us", []).append((applied - decoded) / 1000 / notices)
            assert peers.in_flight() == 0
        row = {"hashes": size, **{name: statistics.median(values) for name, values in timings.items()}}
        row["apply_per_request_us"] = sum(row[f"{k}_apply_us"] for k in ("dispatch", "first_token", "complete"))
        row["per_request_us"] = row["apply_per_request_us"] + sum(
            row[f"{k}_decode_us"] for k in ("dispatch", "first_token", "complete"))
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return rows


def render_sync(rows: list[dict], costs: list[dict], published: dict, *, notices: int = 2000, repeats: int = 9) -> str:
    """The ``bench:gateway_sync`` section: plain vs routing-sync gateway, one run, and the
    in-process cost of applying a peer's notices."""
    plain_cpu = next((r["plain_cpu_ms_per_request"] for r in rows
                      if r["mode"] == "non-stream" and r["concurrency"] == 1), None)
    lines = [
        "## Routing sync: gateway cost (`bench/server/overhead.py --sync`)",
        "",
        seed_line(SYNC_SEED, "the block hashes of the in-process notices; the gateway requests are one fixed chat "
                  "request, the engine returns 16 fixed tokens"),
        "",
        f"Machine: {machine()} (shared; 1-minute load average {os.getloadavg()[0]:.1f} at the end). Two `kvgate serve` "
        "processes (1 uvicorn worker each) on the same fixed-token engine (`bench/server/fixed_engine.py`), both on "
        "Redis admission (`KVGATE_REDIS_URL`, each in its own `KVGATE_REDIS_NAMESPACE`), one plain and one with "
        "`KVGATE_ROUTING_SYNC=true`, so the difference is the sync alone. The same chat completion through each, "
        f"alternating rounds ({SYNC_ROUNDS} per row, order flipped every round); CPU of each gateway process from "
        "/proc over its own rounds. The sync gateway publishes 3 notices per request (checked before the rounds: "
        f"{published['dispatch']} dispatch, {published['first_token']} first-token and {published['complete']} "
        f"complete notices for {published['requests']} requests; a dispatch notice carries this prompt's "
        f"{published['hashes']} block hashes, {published['dispatch_bytes']} bytes) and, subscribed to its pool's "
        "channel, receives them back (dropped as its own before parsing); it has no peer here, so the ratio is the "
        "cost of publishing. Absolute figures drift with the machine's load; the median of the per-round ratios "
        "is the measurement.",
        "",
        "| mode | clients | plain p50 / p99 ms | sync p50 / p99 ms | plain CPU ms/req | sync CPU ms/req | "
        "sync / plain CPU (median; range of rounds) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['plain_p50_ms']:.2f} / {r['plain_p99_ms']:.2f} | "
                     f"{r['sync_p50_ms']:.2f} / {r['sync_p99_ms']:.2f} | {r['plain_cpu_ms_per_request']:.2f} | "
                     f"{r['sync_cpu_ms_per_request']:.2f} | {r['cpu_ratio']:.2f} × ({min(r['ratios']):.2f}–"
                     f"{max(r['ratios']):.2f}) |")
    lines += [
        "",
        "Applying a peer's notices, in-process (no server): `PeerLoads.apply` on a `KvAwareRouter` (the gateway's "
        f"default router, 4 replicas), {notices} peer requests per repetition (random 64-bit block hashes, each "
        f"request its own), all dispatched, then all started, then all completed; median of {repeats} repetitions "
        "(`time.perf_counter_ns`) of µs per notice. `Notice.decode` (what the listener does first) is timed apart; "
        "redis-py's parsing of the message is in neither.",
        "",
        "| block hashes per dispatch | dispatch: decode / apply µs | first_token: decode / apply µs | "
        "complete: decode / apply µs | per peer request: apply / decode + apply µs |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in costs:
        lines.append(f"| {c['hashes']} | {c['dispatch_decode_us']:.2f} / {c['dispatch_apply_us']:.2f} | "
                     f"{c['first_token_decode_us']:.2f} / {c['first_token_apply_us']:.2f} | "
                     f"{c['complete_decode_us']:.2f} / {c['complete_apply_us']:.2f} | "
                     f"{c['apply_per_request_us']:.2f} / {c['per_request_us']:.2f} |")
    example = next((c for c in costs if c["hashes"] == 64), costs[0])
    fleet = 4
    per_own = (fleet - 1) * example["per_request_us"]
    lines += [
        "",
        "What a fleet costs: with G gateways at equal traffic, each gateway applies its G − 1 peers' notices, "
        "(G − 1) × its own request rate of dispatch + first_token + complete notices, i.e. (G − 1) × the "
        "per-peer-request figure above on top of each of its own requests, and receives G times its own rate "
        f"of messages from Redis. For example G = {fleet} with {example['hashes']}-block prompts: "
        f"{fleet - 1} × {example['per_request_us']:.1f} µs = {per_own:.0f} µs per own request, a lower bound (redis-py's "
        "parsing of the G − 1 peers' messages is not in it)"
        + (f", against {plain_cpu:.2f} ms gateway CPU for a plain non-streaming request at 1 client above"
           f" ({100 * per_own / 1000 / plain_cpu:.1f} %)." if plain_cpu else "."),
    ]
    return "\n".join(lines)


async def sync_run(args, key: str, ports: dict[str, int], pids: dict[str, int], namespace: str) -> tuple[dict, list[dict]]:
    """``--sync``: check that the sync gateway publishes, then the alternating rounds."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['sync']}", timeout=60) as http:
        published = await published_notices(args.redis, namespace, http, key)
    return published, await measure_sync(args, key, ports, pids)
