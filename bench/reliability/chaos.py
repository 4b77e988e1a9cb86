"""Chaos: a small fleet of real processes under streaming load while faults land on it.

Two ``kvgate serve`` gateways share Redis admission and a PostgreSQL registry (each
behind a TCP link that can be cut: ``tests/reliability/proxies.py`` ``TcpCut``); one pool
of three engine replicas: the CPU reference engine (``kvgate engine serve``) and two
``bench/server/fixed_engine.py`` processes (the same KServe v2 contract, KV stats included,
6 tokens paced 60 ms apart), each behind a counting proxy that sees every call's tenant, prompt
and generated tokens (the proxies share their counters, so per-tenant concurrency is
counted across the pool). Four salted tenants with different concurrency limits. The
clients stream short answers, spread over both gateways, bounded in count and time, and
retry a refusal (429, 503) after a jittered pause.

Faults, each at a recorded moment: SIGKILL a fixed replica; drain then remove the reference one; SIGTERM a
gateway and start it again (or SIGKILL it, with the usage journal check); cut Redis; cut
PostgreSQL; lower a tenant's concurrency limit and revoke one of its keys.

    python bench/reliability/chaos.py [--streams 1000] [--concurrency 1000] [--no-write]

Figures go to the ``bench:chaos`` section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.reliability.chaos_limits import LeaseSampler, breakdown, max_after_drained, max_at_arrivals  # noqa: E402
from bench.report import machine, write_section  # noqa: E402
from engines.tokenizer import load_gguf_tokenizer  # noqa: E402
from tests.reliability.harness import GatewayProcess, PostgresDatabase, Registry, postgres_port  # noqa: E402
from tests.reliability.proxies import TcpCut  # noqa: E402
from tests.reliability.proxy_fleet import ProxyFleet  # noqa: E402
from tests.reliability.sse import SseParser, StreamResult, chat_body  # noqa: E402
from tests.server.gateway.stack import MODEL, PEPPER, free_port  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
ACTOR = "bench:chaos"
POOL = "chaos"
LIMITS = (4, 8, 16, 32)
QUESTIONS = ["Name one primary colour.", "What is two plus two?", "Say hello politely.", "Name a fruit."]
ALL_FAULTS = ("replica_kill", "replica_drain_remove", "gateway_sigterm", "redis_cut", "postgres_cut",
              "limit_and_revoke")


@dataclass
class ChaosReport:
    streams: int
    concurrency: int
    faults: list[str]
    started: str = ""
    wall_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)  # how each stream ended
    refusals: dict[str, int] = field(default_factory=dict)  # retried answers, by status and code
    fault_times_s: dict[str, float] = field(default_factory=dict)  # seconds after the load started
    double_ended: int = 0  # a stream with two endings (finish and error, two [DONE], ...)
    malformed_frames: int = 0
    truncated_without_error: int = 0
    hung: int = 0  # no first byte within the first-token deadline
    not_generated: list[str] = field(default_factory=list)  # complete streams no engine call explains
    engine_calls: int = 0
    engine_calls_on_killed_replica: int = 0
    limits: dict[str, int] = field(default_factory=dict)
    engine_max_in_flight: dict[str, int] = field(default_factory=dict)
    lowered_limit: dict[str, int] = field(default_factory=dict)
    # Lowered limit (bench/reliability/chaos_limits.py): the criteria are Redis' count when a lease granted
    # after the bound appears, and the engines' once the calls that reached them before it ended.
    engine_max_after_lowering: int = 0
    engine_max_after_lowering_at: dict = field(default_factory=dict)
    engine_max_after_old_drained: int = 0
    redis_leases_after_lowering: dict = field(default_factory=dict)
    revoked_refused_after_s: list[float] = field(default_factory=list)  # per gateway
    revoked_accepted_last_sent_s: list[float] = field(default_factory=list)  # per gateway: latest probe let through
    revoked_key_probes_answered: int = 0  # probes answered (200) before the revocation reached a gateway
    revoked_key_probe_answers: dict[str, int] = field(default_factory=dict)  # the other answers before the 401
    limit_bound_s: float = 0.0
    usage_answered: list[int] = field(default_factory=list)  # requests, prompt, completion (complete streams)
    admitted_then_refused: int = 0  # 503 engine_unavailable / 504 engine_timeout: admitted, so recorded in usage
    usage_recorded: list[int] = field(default_factory=list)
    usage_engine_completion_tokens: int = 0  # what the engines generated for the complete streams
    cut_streams: int = 0  # streams a gateway SIGKILL cut (no terminal event possible)
    journal_segments_left: int = 0  # usage journal files not applied at the end (must be 0)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)
    # Where the time went (measurements, not assertions): the client process' CPU and its event
    # loop's lag, every process' CPU, 503/429s per 10 s of the run, the engines' own answer time.
    harness_cpu_s: float = 0.0
    harness_loop_lag_s: dict[str, float] = field(default_factory=dict)
    process_cpu_s: dict[str, float] = field(default_factory=dict)
    refusal_timeline: dict[str, dict[str, int]] = field(default_factory=dict)
    engine_first_response_s: dict[str, float] = field(default_factory=dict)  # proxy: arrival -> first token
    t0: float = 0.0  # time.monotonic() when the load started (not reported)
    # The soak after the chaos (``soak_s`` > 0): the same fleet, steady moderate load, no faults.
    soak: dict = field(default_factory=dict)
    # Admin writes through a gateway across the PostgreSQL cut: each refused with a clear error
    # (503 database_unavailable) or committed with exactly one audit event.
    admin_writes_during_pg_cut: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "t0"}


@dataclass
class _Fleet:
    db: PostgresDatabase
    pg_link: TcpCut
    redis_link: TcpCut
    registry: Registry
    gateways: list[GatewayProcess]
    fixed: dict[str, subprocess.Popen]
    proxies: ProxyFleet  # the counting proxies, one per replica, in a process of their own
    keys: dict[str, list[str]]
    tenant_ids: dict[str, str]  # engine tenant id -> slug


MAX_ATTEMPTS = 60  # per stream: refusals and failed connects before it gives up


def _retry_after(headers) -> float:
    try:
        return min(30.0, max(0.1, float(headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


FIXED_TOKEN_DELAY_MS = 60  # 6 tokens in ~0.4 s: a kill catches streams before and after their first token


def _start_fixed(port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "server" / "fixed_engine.py"), "--port", str(port),
                             "--tokens", "6", "--token-delay-ms", str(FIXED_TOKEN_DELAY_MS)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT)


async def _build(workdir: Path, reference_port: int) -> _Fleet:
    from tenants import pools
    from tenants.models import Tenant

    db = PostgresDatabase().create()
    pg_link = TcpCut(postgres_port()).start()
    redis_link = TcpCut(6379).start()
    fixed, ports = {}, {}
    for name in ("r1", "r2"):
        ports[name] = free_port()
        fixed[name] = _start_fixed(ports[name], workdir / f"{name}.log")
    proxies = await asyncio.to_thread(ProxyFleet.start, {name: f"127.0.0.1:{port}" for name, port in
                                                          (("r0", reference_port), *ports.items())},
                                      workdir / "proxies.log")
    registry = Registry(db.url, pepper=PEPPER)
    now = datetime.now(UTC)
    with registry.factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name=POOL, model_name=MODEL,
                          replicas=[{"name": n, "endpoint": f"127.0.0.1:{p}"} for n, p in proxies.ports.items()],
                          engine_spec="reference-smollm2", tokens_per_block=16, primary_blocks=512,
                          secondary_blocks=512, secondary_offload_min_priority=30)
    registry.add_class()
    run = secrets.token_hex(2)
    keys: dict[str, list[str]] = {}
    for t, limit in enumerate(LIMITS):
        slug = f"chaos-{t}-{run}"
        keys[slug] = [registry.add_tenant(slug, pool=POOL, isolation="salted", max_concurrent_requests=limit,
                                          rpm_limit=1_000_000, tpm_limit=100_000_000)]
        keys[slug].append(registry.add_key(slug))
    with registry.factory() as session:
        tenant_ids = {str(r.id): r.slug for r in session.query(Tenant).all()}
    gateways = []
    for i in range(2):
        env = {"KVGATE_REDIS_URL": f"redis://127.0.0.1:{redis_link.port}/0",
               "KVGATE_USAGE_JOURNAL_DIR": str(workdir / f"journal{i}"), "KVGATE_DRAIN_TIMEOUT": "20",
               "KVGATE_FIRST_TOKEN_TIMEOUT_S": "10"}
        gateways.append(GatewayProcess(db.url_via(pg_link.port), PEPPER, workdir / f"gw{i}", extra_env=env))
    for g in gateways:
        await asyncio.to_thread(g.start)
    for g in gateways:
        await asyncio.to_thread(g.wait_ready)
    return _Fleet(db, pg_link, redis_link, registry, gateways, fixed, proxies, keys, tenant_ids)


async def _one_stream(http: httpx.AsyncClient, fleet: _Fleet, i: int, slug: str, key_index: int, question: int,
                      report: ChaosReport, rng: random.Random, deadline: float, first_token_s: float,
                      results: list) -> None:
    body = chat_body([{"role": "user", "content": QUESTIONS[question]}], max_tokens=6)
    attempts = 0
    while time.monotonic() < deadline:
        gateway = fleet.gateways[(i + rng.randrange(2)) % 2]
        result = StreamResult(0)
        parser = SseParser(result)
        key = fleet.keys[slug][key_index]
        ends = 0
        try:
            async with http.stream("POST", gateway.base_url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"},
                                   timeout=httpx.Timeout(60.0, read=first_token_s + 30)) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        code = json.loads(raw)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "unparsable"
                    name = f"{r.status_code} {code}"
                    report.refusals[name] = report.refusals.get(name, 0) + 1
                    bucket = report.refusal_timeline.setdefault(str(int((time.monotonic() - report.t0) // 10 * 10)), {})
                    bucket[name] = bucket.get(name, 0) + 1
                    if r.status_code == 401 and key_index == 1:  # the revoked key: the other one from now on
                        key_index = 0
                    attempts += 1
                    if attempts >= MAX_ATTEMPTS:
                        break
                    # As a well-behaved client: wait what Retry-After asks, stretched by a random
                    # 0-100 % so the refused do not come back in one wave (a 0.1-0.6 s pause that
                    # ignored it made 1,000 clients a retry storm: measured 2,646 × 429 and
                    # 2,545 × 503 in one run).
                    await asyncio.sleep(_retry_after(r.headers) * (1 + rng.random()))
                    continue
                async for line in r.aiter_lines():
                    parser.line(line)
                    if line == "data: [DONE]" or (line.startswith("data: ") and '"error"' in line[:16]):
                        ends += 1
        except httpx.ReadTimeout:
            results.append((i, slug, question, "hung", result))
            return
        except httpx.HTTPError:
            if result.status == 200:  # started, then the gateway vanished (SIGKILL): nothing more can come
                results.append((i, slug, question, "cut", result))
                return
            attempts += 1
            if attempts >= MAX_ATTEMPTS:
                break
            await asyncio.sleep(0.5 + rng.random() * 0.5)  # could not connect: that gateway is restarting
            continue
        if ends > 1:
            report.double_ended += 1
        report.malformed_frames += result.malformed
        if result.complete:
            results.append((i, slug, question, "complete", result))
        elif result.error is not None:
            results.append((i, slug, question, f"error {result.error.get('code')}", result))
        else:
            results.append((i, slug, question, "truncated", result))
        return
    results.append((i, slug, question, "gave_up", StreamResult(0)))


async def run_chaos(*, reference_port: int, workdir: Path, streams: int = 1000, concurrency: int = 1000,
                    faults: tuple[str, ...] = ALL_FAULTS, gateway_kill: bool = False, seed: int = 11,
                    time_budget_s: float = 240.0, first_token_s: float = 10.0, spread_s: float = 60.0,
                    soak_s: float = 0.0, soak_concurrency: int = 16, soak_warmup_s: float = 60.0,
                    reference_pid: int | None = None) -> ChaosReport:
    """One bounded run; see the module docstring. ``gateway_kill``: SIGKILL (not SIGTERM) a gateway
    mid-run and check the usage journal's replay at the end. Streams start at random moments
    over the first ``spread_s`` seconds, so the faults land on traffic.

    ``soak_s`` > 0: after the chaos load, the same fleet (what the faults left of it) carries
    ``soak_concurrency`` clients streaming back to back for ``soak_s`` seconds; RSS and open
    file descriptors of every process (gateways, engines, the proxy process, this one) are
    sampled every 10 s, and growth is measured from the first sample after ``soak_warmup_s``
    to the last (``report.soak``). Soak streams count in the usage check like any other."""
    from tenants import keys as keys_mod, tenant as tenant_mod, replicas as replicas_mod
    from tenants.models import AuditEvent, Tenant, Usage
    from sqlalchemy import func, select

    report = ChaosReport(streams, concurrency, list(faults) + (["gateway_sigkill"] if gateway_kill else []),
                         started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    rng = random.Random(seed)
    fleet = await _build(workdir, reference_port)
    slugs = list(fleet.keys)
    report.limits = dict(zip(slugs, LIMITS, strict=True))
    t0 = time.monotonic()
    report.t0 = t0
    cpu0 = _self_cpu()
    deadline = t0 + time_budget_s
    results: list = []
    lags: list[float] = []
    limit_in_force: dict[str, int] = dict(report.limits)
    lowered_at = [None]
    sampler: list = [None]
    admin_answers: list[tuple[int | None, int, str]] = []  # (value written or None, status, error code)
    try:
        report.rss_mib["before"] = [round(g.rss_bytes() / 2**20, 1) for g in fleet.gateways]

        def mark(name: str) -> None:
            report.fault_times_s[name] = round(time.monotonic() - t0, 2)

        def registry_write(fn, **kwargs) -> None:
            with fleet.registry.factory() as session:
                fn(session, actor=ACTOR, now=datetime.now(UTC), **kwargs)

        async def inject() -> None:
            await asyncio.sleep(1.5)
            if "replica_kill" in faults:
                fleet.fixed["r1"].send_signal(signal.SIGKILL)
                mark("replica_kill (SIGKILL r1)")
            await asyncio.sleep(1.0)
            if "replica_drain_remove" in faults:
                # Why the reference engine: a fixed replica must survive to carry the load (the
                # reference engine alone, batch 16 on a shared CPU, cannot serve 1,000 streams).
                await asyncio.to_thread(registry_write, replicas_mod.drain_replica, pool=POOL, name="r0")
                mark("replica r0 (reference) draining")
            if gateway_kill:
                fleet.gateways[1].signal(signal.SIGKILL)
                await asyncio.to_thread(fleet.gateways[1].wait, 10)
                mark("gateway 1 SIGKILL")
                await asyncio.to_thread(fleet.gateways[1].start)
                mark("gateway 1 restarted")
            elif "gateway_sigterm" in faults:
                fleet.gateways[1].signal(signal.SIGTERM)
                mark("gateway 1 SIGTERM")
                await asyncio.to_thread(fleet.gateways[1].wait, 40)
                mark("gateway 1 exited")
                await asyncio.to_thread(fleet.gateways[1].start)
                mark("gateway 1 restarted")
            if "replica_drain_remove" in faults:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(registry_write, replicas_mod.remove_replica, pool=POOL, name="r0")
                mark("replica r0 (reference) removed")
            if "limit_and_revoke" in faults:
                slug = slugs[3]
                with fleet.registry.factory() as session:
                    row = session.scalars(select(Tenant).where(Tenant.slug == slug)).one()
                    version = row.version
                new_limit = 4
                await asyncio.to_thread(registry_write, tenant_mod.update_tenant, ref=slug, version=version,
                                        changes={"max_concurrent_requests": new_limit})
                with fleet.registry.factory() as session:
                    key_ids = [k.id for k in keys_mod.list_keys(session, tenant=slug, limit=10, offset=0).items]
                await asyncio.to_thread(registry_write, keys_mod.revoke_key, tenant=slug, key_id=max(key_ids))
                changed = time.monotonic()
                mark("limit lowered and key revoked")
                report.lowered_limit = {slug: new_limit}
                limit_in_force[slug] = new_limit
                report.limit_bound_s = 5.0  # auth TTL of `kvgate serve` (server/gateway/fresh_admission.py)
                lowered_at[0] = changed
                sampler[0] = LeaseSampler(slug, changed).start()
                async def probe(g: GatewayProcess) -> float:
                    """Probe one gateway with the revoked key, one probe sent every 0.1 s whatever
                    the earlier ones are doing, from the change until ``limit_bound_s`` + 2 s have
                    passed and one was refused; return the moment (seconds after the change) from
                    which every probe *sent* that was answered was refused with 401. Why sending
                    time: a probe is decided at or after it is sent, so a probe sent after that
                    moment and refused proves the revocation in force, however long its answer
                    took on a loaded machine. A probe with no answer (transport error) proves
                    nothing either way: counted, not used."""
                    seen: list[tuple[float, int]] = []

                    async def one(client: httpx.AsyncClient) -> None:
                        sent = time.monotonic() - changed
                        try:
                            r = await client.post(g.base_url + "/v1/chat/completions",
                                                  headers={"Authorization": f"Bearer {revoked}"},
                                                  json=chat_body([{"role": "user", "content": "hi"}],
                                                                 max_tokens=1, stream=False))
                            status = r.status_code
                        except httpx.HTTPError:
                            status = 0
                        seen.append((sent, status))
                        probe_latencies.append(time.monotonic() - changed - sent)
                        if status == 200:
                            report.revoked_key_probes_answered += 1
                        if status != 401:
                            name = str(status) if status else "transport error"
                            report.revoked_key_probe_answers[name] = report.revoked_key_probe_answers.get(name, 0) + 1

                    async with httpx.AsyncClient(timeout=30) as client:
                        tasks = []
                        while time.monotonic() - changed < 30:
                            if any(st == 401 for _, st in seen) and time.monotonic() - changed > report.limit_bound_s + 2:
                                break
                            tasks.append(asyncio.create_task(one(client)))
                            await asyncio.sleep(0.1)
                        await asyncio.gather(*tasks)
                    accepted = [t for t, status in seen if status not in (0, 401)]
                    refused_from = sorted(t for t, status in seen if status == 401 and (not accepted or t > max(accepted)))
                    last_accepted.append(round(max(accepted), 2) if accepted else 0.0)
                    return round(refused_from[0], 2) if refused_from else 30.0

                revoked = fleet.keys[slug][1]
                probe_latencies: list[float] = []
                last_accepted: list[float] = []
                report.revoked_refused_after_s = list(await asyncio.gather(*(probe(g) for g in fleet.gateways)))
                report.revoked_accepted_last_sent_s = last_accepted
                probe_latencies.sort()
                report.revoked_key_probe_answers["answer_s_p50_max"] = [round(probe_latencies[len(probe_latencies) // 2], 2),
                                                                        round(probe_latencies[-1], 2)]
            if "redis_cut" in faults:
                fleet.redis_link.cut()
                mark("Redis cut")
                await asyncio.sleep(5)
                fleet.redis_link.restore()
                mark("Redis restored")
            if "postgres_cut" in faults:
                fleet.pg_link.cut()
                mark("PostgreSQL cut")
                writer = asyncio.create_task(admin_writer(time.monotonic() + 12))
                await asyncio.sleep(10)
                fleet.pg_link.restore()
                mark("PostgreSQL restored")
                await writer

        async def admin_writer(until: float) -> None:
            """Admin writes through gateway 0 across the PostgreSQL cut and 2 s past the restore:
            read the version, PATCH tenant 0's rpm_limit to a fresh value; every answer kept."""
            slug = slugs[0]
            base = fleet.gateways[0].base_url + "/admin/v1/tenants/" + slug
            headers = {"Authorization": f"Bearer {fleet.gateways[0].admin_token}"}
            value = ADMIN_WRITE_BASE
            async with httpx.AsyncClient(timeout=10, headers=headers) as admin:
                while time.monotonic() < until:
                    try:
                        got = await admin.get(base)
                        if got.status_code != 200:
                            admin_answers.append((None, got.status_code, _admin_code(got)))
                        else:
                            value += 1
                            r = await admin.patch(base, json={"version": got.json()["version"], "rpm_limit": value})
                            admin_answers.append((value, r.status_code, "" if r.status_code == 200 else _admin_code(r)))
                    except httpx.HTTPError:
                        admin_answers.append((None, 0, "transport error"))
                    await asyncio.sleep(0.2)

        sem = asyncio.Semaphore(concurrency)
        connections = httpx.Limits(max_connections=concurrency + 32, max_keepalive_connections=concurrency + 32)
        plan = [(i, slugs[i % len(slugs)], rng.randrange(2), rng.randrange(len(QUESTIONS))) for i in range(streams)]

        async def paced(i, slug, key_index, question) -> None:
            await asyncio.sleep(rng.random() * spread_s)  # spread over the fault window
            async with sem:
                await _one_stream(http, fleet, i, slug, key_index, question, report, rng, deadline, first_token_s,
                                  results)

        async def sample_lag() -> None:  # how late the client loop wakes from a 50 ms sleep
            while True:
                before = time.monotonic()
                await asyncio.sleep(0.05)
                lags.append(time.monotonic() - before - 0.05)

        lagger = asyncio.create_task(sample_lag())
        async with httpx.AsyncClient(limits=connections) as http:
            injector = asyncio.create_task(inject())
            await asyncio.gather(*(paced(*p) for p in plan))
            await injector
            if soak_s > 0:
                report.soak = await _soak(http, fleet, report, results, rng, seconds=soak_s,
                                          concurrency=soak_concurrency, warmup_s=soak_warmup_s,
                                          first_token_s=first_token_s, reference_pid=reference_pid)
        lagger.cancel()
        report.wall_s = round(time.monotonic() - t0, 1)
        report.harness_cpu_s = round(_self_cpu() - cpu0, 1)
        lags.sort()
        if lags:
            report.harness_loop_lag_s = {"p50": round(lags[len(lags) // 2], 3), "p99": round(lags[int(len(lags) * 0.99)], 3),
                                         "max": round(lags[-1], 3), "samples_over_1s": sum(1 for x in lags if x > 1.0)}
        for i, g in enumerate(fleet.gateways):
            report.process_cpu_s[f"gateway{i} (current process)"] = _proc_cpu(g.proc.pid)
        for name, proc in fleet.fixed.items():
            if proc.poll() is None:
                report.process_cpu_s[f"fixed {name}"] = _proc_cpu(proc.pid)
        report.rss_mib["after"] = [round(g.rss_bytes() / 2**20, 1) for g in fleet.gateways]
        # How each stream ended, and whether a complete one is exactly what an engine generated.
        report.outcomes = dict(Counter(kind for i, _, _, kind, _ in results if i < streams))  # the soak's: report.soak
        report.hung = report.outcomes.get("hung", 0)
        report.truncated_without_error = report.outcomes.get("truncated", 0)
        report.cut_streams = report.outcomes.get("cut", 0)
        tokenizer = load_gguf_tokenizer()
        calls = [SimpleNamespace(**c) for c in (await asyncio.to_thread(fleet.proxies.ask, "calls"))["calls"]]
        report.engine_calls = len(calls)
        waits = sorted(c.first_response - c.arrived for c in calls if c.first_response is not None)
        if waits:
            report.engine_first_response_s = {"p50": round(waits[len(waits) // 2], 3),
                                              "p99": round(waits[int(len(waits) * 0.99)], 3), "max": round(waits[-1], 3),
                                              "never": sum(1 for c in calls if c.first_response is None)}
        report.engine_calls_on_killed_replica = sum(1 for c in calls if c.replica == "r1" and not c.final)
        engine_side = Counter((fleet.tenant_ids.get(c.tenant_id, c.tenant_id), tokenizer.decode(c.output_ids),
                               len(c.output_ids)) for c in calls if c.final)
        client_side = Counter((slug, r.text, r.usage["completion_tokens"])
                              for _, slug, _, kind, r in results if kind == "complete")
        report.not_generated = [str(k) for k in (client_side - engine_side)][:5]
        answered = [r for _, _, _, kind, r in results if kind == "complete"]
        report.usage_answered = [len(answered), sum(r.usage["prompt_tokens"] for r in answered),
                                 sum(r.usage["completion_tokens"] for r in answered)]
        report.usage_engine_completion_tokens = sum(n * count for (_, _, n), count in (client_side & engine_side).items())
        max_in_flight = (await asyncio.to_thread(fleet.proxies.ask, "max_in_flight"))["max_in_flight"]
        report.engine_max_in_flight = {fleet.tenant_ids.get(k, k): v for k, v in max_in_flight.items()}
        if lowered_at[0] is not None:
            tid = next(k for k, v in fleet.tenant_ids.items() if v == slugs[3])
            report.engine_max_after_lowering = max_at_arrivals(
                [c for c in calls if c.tenant_id == tid], after=lowered_at[0] + report.limit_bound_s)
            lowered = [c for c in calls if c.tenant_id == tid]
            report.engine_max_after_lowering_at = breakdown(lowered, changed=lowered_at[0],
                                                            bound_s=report.limit_bound_s)
            report.engine_max_after_old_drained = max_after_drained(lowered, bound=lowered_at[0] + report.limit_bound_s)
            if sampler[0] is not None:
                report.redis_leases_after_lowering = sampler[0].stop(bound_s=report.limit_bound_s)
        report.admitted_then_refused = sum(v for k, v in report.refusals.items()
                                           if k in ("503 engine_unavailable", "504 engine_timeout"))
        # Usage: stop both gateways gracefully (flush), then a fresh start replays any journal left.
        for g in fleet.gateways:
            await asyncio.to_thread(g.stop)
        for i, g in enumerate(fleet.gateways):
            if list((workdir / f"journal{i}").glob("usage-*.jsonl")):  # left unapplied: a start replays it
                await asyncio.to_thread(g.start)
                await asyncio.to_thread(g.wait_ready)
                await asyncio.to_thread(g.stop)
        report.journal_segments_left = sum(len(list((workdir / f"journal{i}").glob("usage-*.jsonl")))
                                           for i in range(len(fleet.gateways)))
        with fleet.registry.factory() as session:
            row = session.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                         func.coalesce(func.sum(Usage.prompt_tokens), 0),
                                         func.coalesce(func.sum(Usage.completion_tokens), 0))
                                  .join(Tenant, Tenant.id == Usage.tenant_id)
                                  .where(Tenant.slug.in_(slugs))).one()
        report.usage_recorded = [int(row[0]), int(row[1]), int(row[2])]
        if admin_answers:
            with fleet.registry.factory() as session:
                tid = session.scalars(select(Tenant.id).where(Tenant.slug == slugs[0])).one()
                events = session.scalars(select(AuditEvent).where(AuditEvent.action == "tenant.update",
                                                                  AuditEvent.entity_id == str(tid))).all()
            audited = [(e.after or {}).get("rpm_limit") for e in events]
            audited = [v for v in audited if isinstance(v, int) and v > ADMIN_WRITE_BASE]
            acknowledged = [v for v, status, _ in admin_answers if status == 200]
            report.admin_writes_during_pg_cut = {
                "answers": dict(Counter(f"{status} {code}".strip() for _, status, code in admin_answers)),
                "acknowledged": len(acknowledged), "audited": len(audited),
                "acknowledged_without_audit": len(set(acknowledged) - set(audited)),
                "audited_twice": len(audited) - len(set(audited)),
                "audited_but_refused": len(set(audited) - set(acknowledged)),
                "unclear_refusals": sum(1 for _, status, code in admin_answers
                                        if status != 200 and (status, code) != (503, "database_unavailable"))}
        return report
    finally:
        for g in fleet.gateways:
            await asyncio.to_thread(g.stop)
        for proc in fleet.fixed.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        await asyncio.to_thread(fleet.proxies.stop)
        fleet.redis_link.close()
        fleet.pg_link.close()
        fleet.db.drop()


def _processes(fleet: _Fleet, reference_pid: int | None) -> dict[str, int]:
    import os

    named = {f"gateway{i}": g.proc.pid for i, g in enumerate(fleet.gateways) if g.proc and g.proc.poll() is None}
    named.update({f"fixed {n}": p.pid for n, p in fleet.fixed.items() if p.poll() is None})
    if reference_pid is not None:
        named["reference engine"] = reference_pid
    named["proxy process (harness)"] = fleet.proxies.proc.pid
    named["clients (harness)"] = os.getpid()
    return named


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _soak(http: httpx.AsyncClient, fleet: _Fleet, report: ChaosReport, results: list, rng: random.Random, *,
                seconds: float, concurrency: int, warmup_s: float, first_token_s: float,
                reference_pid: int | None) -> dict:
    """Steady streaming after the chaos; see :func:`run_chaos`. Returns the soak's figures."""
    slugs = list(fleet.keys)
    start = time.monotonic()
    end = start + seconds
    first_soak = len(results)
    samples: list[dict] = []
    procs = _processes(fleet, reference_pid)

    async def sample() -> None:
        while True:
            samples.append({"t": round(time.monotonic() - start, 1),
                            "rss_mib": {n: _rss_mib(pid) for n, pid in procs.items()},
                            "fds": {n: _fds(pid) for n, pid in procs.items()}})
            if time.monotonic() >= end:
                return
            await asyncio.sleep(min(10.0, max(0.0, end - time.monotonic())))

    async def worker(w: int) -> None:
        i = report.streams + w
        while time.monotonic() < end:
            await _one_stream(http, fleet, i, slugs[w % len(slugs)], 0, rng.randrange(len(QUESTIONS)), report,
                              rng, end + 60, first_token_s, results)
            i += concurrency

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    await sampler
    base = next((x for x in samples if x["t"] >= warmup_s), samples[0])
    last = samples[-1]
    return {"seconds": seconds, "concurrency": concurrency, "warmup_s": warmup_s,
            "streams": dict(Counter(kind for _, _, _, kind, _ in results[first_soak:])),
            "rss_mib_at_warmup": base["rss_mib"], "rss_mib_last": last["rss_mib"],
            "rss_growth_mib": {n: round(last["rss_mib"][n] - base["rss_mib"][n], 1) for n in procs},
            "fds_at_warmup": base["fds"], "fds_last": last["fds"],
            "fd_growth": {n: last["fds"][n] - base["fds"][n] for n in procs},
            "samples": len(samples)}


ADMIN_WRITE_BASE = 5_000_000  # rpm_limit values the admin writer sets: above it, so its audit events are known


def _admin_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsable"


def _self_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat`` fields 14 and 15)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def render(report: ChaosReport) -> str:
    d = report.as_dict()
    lines = ["## Chaos run (`bench/reliability/chaos.py`)", "",
             f"Run {report.started}; machine: {machine()}. {report.streams} streams (max {report.concurrency} "
             f"concurrent, 6 output tokens) over 2 `kvgate serve` (Redis admission, PostgreSQL registry), "
             "3 replicas (reference engine + 2 fixed engines), 4 salted tenants.", "",
             "| figure | value |", "|---|---|"]
    for name, value in d.items():
        if name in ("streams", "concurrency", "started"):
            continue
        shown = json.dumps(value) if isinstance(value, (dict, list)) else value
        lines.append(f"| {name} | {shown} |")
    return "\n".join(lines) + "\n"


async def _main(args) -> ChaosReport:
    from tests.reliability.conftest import ENGINE_ARGS
    from tests.server.gateway.stack import EngineProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    engine = EngineProcess(free_port(), ENGINE_ARGS, workdir / "engine.log")
    await asyncio.to_thread(engine.start)
    try:
        return await run_chaos(reference_port=engine.port, workdir=workdir, streams=args.streams,
                               concurrency=args.concurrency, time_budget_s=args.time_budget,
                               spread_s=args.spread, soak_s=args.soak, reference_pid=engine.proc.pid)
    finally:
        engine.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--time-budget", type=float, default=240.0)
    parser.add_argument("--spread", type=float, default=60.0, help="streams start over this many seconds")
    parser.add_argument("--soak", type=float, default=0.0, help="then this many seconds of steady load (0: none)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(_main(args))
    body = render(report)
    print(body)
    if not args.no_write:
        write_section("chaos", body, path=DOC)


if __name__ == "__main__":
    main()
