"""Faults production brings, each with recovery asserted.

* the engine killed mid-stream: the client gets a terminal error event, not a hang, and
  the first request after the engine is back succeeds;
* a client disconnecting mid-stream: the engine request is cancelled (seen at the
  engine's door) and its blocks go back to the pool;
* SIGTERM to ``kvgate serve``: streams in flight finish, new requests get 503
  ``shutting_down``, the process exits once drained;
* the registry database unavailable (PostgreSQL behind a TCP link we cut): cached keys
  keep being served, new keys and the admin API get 503, nothing is written partially,
  and usage counted during the outage is written exactly once afterwards.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import threading
import time

import httpx
import pytest
from sqlalchemy import func, select

from server.gateway.replicas.engine_client import EngineClient
from tenants import pools
from tenants.models import AuditEvent, Tenant, Usage
from tests.reliability.harness import GatewayProcess, PostgresDatabase, Registry, postgres_port
from tests.reliability.proxies import TcpCut, run_counting_proxy_in_thread
from tests.reliability.sse import SseParser, StreamResult, chat_body
from tests.server.gateway.stack import ACTOR, MODEL, PEPPER, Stack
from tests.server.gateway.test_openai_e2e import metric
from tests.tenants.fixtures import postgres_reachable

QUESTION = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def used_blocks(engine_port: int) -> int:
    """Primary blocks referenced by running requests, from the engine's stats call."""

    async def read() -> int:
        client = EngineClient(f"127.0.0.1:{engine_port}", "kvgate_llm")
        try:
            return (await client.stats()).primary.used_blocks
        finally:
            await client.close()

    return asyncio.run(read())


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


@pytest.mark.reliability  # restarting the engine costs ~10 s
def test_engine_killed_mid_stream_ends_the_stream_with_an_error_then_recovers(stack: Stack, figures) -> None:
    slug = "ek-" + secrets.token_hex(3)
    key = stack.add_tenant(slug, max_concurrent_requests=1)
    result = StreamResult(0)
    parser = SseParser(result)
    started = time.monotonic()
    try:
        with httpx.stream("POST", stack.gateway.base_url + "/v1/chat/completions", headers=auth(key),
                          json=chat_body(QUESTION, max_tokens=120), timeout=httpx.Timeout(30.0)) as response:
            result.status = response.status_code
            killed = False
            for line in response.iter_lines():
                parser.line(line)
                if result.text and not killed:
                    stack.engine.kill()  # mid-stream: the first tokens are out
                    killed_at = time.monotonic()
                    killed = True
        ended_after_kill = time.monotonic() - killed_at
    finally:
        stack.engine.start()
    assert result.status == 200 and killed
    assert result.error is not None and result.error["code"] == "engine_unavailable", result
    assert not result.done and result.finish_reasons == []
    # The lease was released: this tenant (max 1 concurrent) is admitted again at once.
    reply = httpx.post(stack.gateway.base_url + "/v1/chat/completions", headers=auth(key), timeout=60,
                       json=chat_body([{"role": "user", "content": "Say hi"}], max_tokens=3, stream=False))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    assert metric(stack, "kvgate_requests_total", tenant=slug, pool="reference", status="engine_error") == 1
    figures.record("faults: engine killed mid-stream", terminal_error_event=result.error["code"],
                   stream_ended_after_kill_s=round(ended_after_kill, 2), tokens_before_kill=len(result.text),
                   recovered_total_s=round(time.monotonic() - started, 1))


@pytest.mark.reliability
def test_client_disconnect_cancels_the_engine_request_and_frees_its_blocks(stack: Stack, figures) -> None:
    proxy, port, stop = run_counting_proxy_in_thread(f"127.0.0.1:{stack.engine.port}")
    try:
        pool = "cut-" + secrets.token_hex(3)
        with stack.session_factory() as session:
            pools.create_pool(session, actor=ACTOR, now=stack.now(), name=pool, model_name=MODEL,
                              triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2",
                              tokens_per_block=stack.tokens_per_block, primary_blocks=512, secondary_blocks=512,
                              secondary_offload_min_priority=30)
        slug = "cd-" + secrets.token_hex(3)
        key = stack.add_tenant(slug, pool=pool, max_concurrent_requests=1)
        baseline = used_blocks(stack.engine.port)
        received = 0
        with httpx.stream("POST", stack.gateway.base_url + "/v1/chat/completions", headers=auth(key),
                          json=chat_body(QUESTION, max_tokens=120), timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if '"content"' in line:
                    received += 1
                    if received == 3:
                        break  # leaving the block closes the connection mid-stream
        tenant_id = next(iter(proxy.started))
        wait_for(lambda: proxy.in_flight[tenant_id] == 0, 20, "the engine call to end")
        wait_for(lambda: used_blocks(stack.engine.port) == baseline, 20, "blocks to return to the pool")
        responses = proxy.responses[tenant_id]
        assert proxy.started[tenant_id] == 1 and proxy.finished[tenant_id] == 1
        assert responses < 60, f"the engine kept generating after the client left ({responses} responses)"
        wait_for(lambda: metric(stack, "kvgate_requests_total", tenant=slug, pool=pool, status="client_gone") == 1,
                 10, "the client_gone metric")
        # The lease went with it: max 1 concurrent, and the next request is admitted.
        reply = httpx.post(stack.gateway.base_url + "/v1/completions", headers=auth(key), timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        figures.record("faults: client disconnect", engine_responses_before_cancel=responses,
                       max_tokens_requested=120, engine_used_blocks_before_and_after=baseline)
    finally:
        stop()


@pytest.fixture
def sqlite_registry(stack: Stack, tmp_path) -> Registry:
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", pepper=PEPPER)
    registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
    registry.add_class()
    return registry


@pytest.mark.reliability
def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(sqlite_registry: Registry, tmp_path, figures) -> None:
    key = sqlite_registry.add_tenant("drain", pool="reference")
    gateway = GatewayProcess(sqlite_registry.url, PEPPER, tmp_path / "gw", extra_env={"KVGATE_DRAIN_TIMEOUT": "60"})
    gateway.start()
    try:
        gateway.wait_ready()
        streams: list[StreamResult] = [StreamResult(0) for _ in range(3)]
        first_token = [threading.Event() for _ in streams]

        def run(i: int) -> None:
            parser = SseParser(streams[i])
            with httpx.stream("POST", gateway.base_url + "/v1/chat/completions", headers=auth(key),
                              json=chat_body(QUESTION, max_tokens=64), timeout=90) as response:
                streams[i].status = response.status_code
                for line in response.iter_lines():
                    parser.line(line)
                    if streams[i].text:
                        first_token[i].set()
            first_token[i].set()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(streams))]
        for t in threads:
            t.start()
        for event in first_token:
            assert event.wait(90)
        assert all(not s.done for s in streams), "streams finished before the signal; make them longer"
        gateway.signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_for(lambda: httpx.get(gateway.base_url + "/readyz", timeout=5).status_code == 503, 10, "readyz 503")
        refused = httpx.post(gateway.base_url + "/v1/chat/completions", headers=auth(key), timeout=10,
                             json=chat_body(QUESTION, max_tokens=4, stream=False))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
        for t in threads:
            t.join(90)
        assert all(s.complete for s in streams), streams
        assert all(s.usage["completion_tokens"] == 64 or s.finish_reasons == ["stop"] for s in streams)
        code = gateway.wait(30)
        exited_after = time.monotonic() - signalled
        assert code == 0  # drained and exited normally (so `kvgate serve` could stop an engine child)
        figures.record("faults: SIGTERM drain", streams_in_flight=len(streams),
                       streams_completed=sum(s.complete for s in streams), new_request_status=refused.status_code,
                       exit_after_signal_s=round(exited_after, 1), drain_timeout_s=60)
    finally:
        gateway.stop()


# Database outage -------------------------------------------------------------------------------
pg_only = pytest.mark.skipif(not postgres_reachable(), reason="PostgreSQL at 127.0.0.1:5432 is not reachable")


@pg_only
@pytest.mark.reliability_full
def test_database_outage_serves_cached_keys_refuses_writes_and_loses_nothing(stack: Stack, tmp_path, figures) -> None:
    db = PostgresDatabase().create()
    link = TcpCut(postgres_port()).start()
    gateway = None
    stop_writer = threading.Event()
    try:
        registry = Registry(db.url, pepper=PEPPER)  # direct: the test's own view, never cut
        registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
        registry.add_class()
        key = registry.add_tenant("cached", pool="reference")
        fresh_key = registry.add_tenant("fresh", pool="reference")
        gateway = GatewayProcess(db.url_via(link.port), PEPPER, tmp_path / "gw")
        gateway.start()
        gateway.wait_ready()
        admin = {"Authorization": f"Bearer {gateway.admin_token}"}
        http = httpx.Client(base_url=gateway.base_url, timeout=60)
        body = chat_body([{"role": "user", "content": "Say hi"}], max_tokens=2, stream=False)

        def ask(k: str) -> httpx.Response:
            return http.post("/v1/chat/completions", headers=auth(k), json=body)

        with registry.factory() as session:
            audit_before = session.scalar(select(func.count()).select_from(AuditEvent))
        served = [ask(key)]
        assert served[0].status_code == 200, served[0].text
        # An admin writer keeps updating a tenant across the cut and the restore.
        writes = {"ok": 0, "unavailable": 0, "other": []}

        def writer() -> None:
            with httpx.Client(base_url=gateway.base_url + "/admin/v1", headers=admin, timeout=30) as w:
                value = 1000
                while not stop_writer.is_set():
                    try:
                        version = w.get("/tenants/fresh")
                        if version.status_code != 200:
                            if version.status_code == 503:
                                writes["unavailable"] += 1
                            else:
                                writes["other"].append(f"GET {version.status_code} {version.text[:200]}")
                            time.sleep(0.1)
                            continue
                        value += 1
                        r = w.patch("/tenants/fresh", json={"version": version.json()["version"], "rpm_limit": value})
                    except httpx.HTTPError as exc:
                        writes["other"].append(repr(exc))
                        time.sleep(0.1)
                        continue
                    if r.status_code == 200:
                        writes["ok"] += 1
                    elif r.status_code == 503:
                        writes["unavailable"] += 1
                    else:
                        writes["other"].append(f"{r.status_code} {r.text[:200]}")
                    time.sleep(0.05)

        with registry.factory() as session:
            fresh_version = session.scalars(select(Tenant.version).where(Tenant.slug == "fresh")).one()
        writer_thread = threading.Thread(target=writer, daemon=True)
        writer_thread.start()
        time.sleep(1.0)

        link.cut()
        cut_at = time.monotonic()
        outage = {"served": 0, "other": []}
        # The auth TTL of `kvgate serve` is 5 s: keep asking for longer than that.
        while time.monotonic() - cut_at < 8:
            r = ask(key)
            if r.status_code == 200:
                served.append(r)
                outage["served"] += 1
            else:
                outage["other"].append((r.status_code, r.text[:200]))
        new_key = ask(fresh_key)
        create = http.post("/admin/v1/tenants", headers=admin,
                           json={"slug": "ghost", "display_name": "Ghost", "pool": "reference",
                                 "retention_class": "standard"})
        listing = http.get("/admin/v1/tenants", headers=admin)
        ready = http.get("/readyz")
        link.restore()
        assert outage["other"] == [], outage["other"][:3]
        assert outage["served"] >= 3
        assert new_key.status_code == 503 and new_key.json()["error"]["code"] == "registry_unavailable"
        for r in (create, listing):
            assert r.status_code == 503, r.text
            assert r.json() == {"error": {"code": "database_unavailable", "message": r.json()["error"]["message"],
                                          "field": None}}
        assert ready.status_code == 503 and ready.json()["checks"]["registry"].startswith("unavailable")

        # Recovery: new keys work again, the admin API answers, usage arrives exactly once.
        wait_for(lambda: ask(fresh_key).status_code == 200, 30, "the registry to be usable again", interval=0.5)
        assert http.get("/admin/v1/tenants", headers=admin).status_code == 200
        time.sleep(1.0)
        stop_writer.set()
        writer_thread.join(30)
        assert writes["other"] == [] and writes["ok"] > 0 and writes["unavailable"] > 0, writes
        with registry.factory() as session:
            fresh = session.scalars(select(Tenant).where(Tenant.slug == "fresh")).one()
            updates = session.scalars(select(AuditEvent).where(AuditEvent.action == "tenant.update",
                                                               AuditEvent.entity_id == str(fresh.id))).all()
        # No partial writes: every committed update has its audit event and vice versa; a
        # write whose answer was lost at the cut may have committed (at most one in flight).
        assert len(updates) == fresh.version - fresh_version
        assert writes["ok"] <= len(updates) <= writes["ok"] + 1
        expected_requests = len(served)
        expected_completion = sum(r.json()["usage"]["completion_tokens"] for r in served)

        def usage_of(slug: str) -> tuple[int, int]:
            with registry.factory() as session:
                row = session.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                             func.coalesce(func.sum(Usage.completion_tokens), 0))
                                      .join(Tenant, Tenant.id == Usage.tenant_id)
                                      .where(Tenant.slug == slug)).one()
                return int(row[0]), int(row[1])

        wait_for(lambda: usage_of("cached")[0] >= expected_requests, 30, "usage to be flushed")
        time.sleep(3)  # one more flush interval: a double count would show now
        assert usage_of("cached") == (expected_requests, expected_completion)
        with registry.factory() as session:
            assert session.scalars(select(Tenant).where(Tenant.slug == "ghost")).first() is None
            audit_after = session.scalar(select(func.count()).select_from(AuditEvent))
            assert audit_after == audit_before + len(updates)
        figures.record("faults: database outage (PostgreSQL link cut)", outage_s=8,
                       cached_key_requests_served_during_outage=outage["served"],
                       cached_key_failures_during_outage=len(outage["other"]),
                       uncached_key_status=new_key.status_code, admin_write_status=create.status_code,
                       admin_writer_ok=writes["ok"], admin_writer_503=writes["unavailable"],
                       updates_committed=len(updates), audit_events_for_them=len(updates),
                       usage_requests_expected=expected_requests, usage_requests_recorded=usage_of("cached")[0])
    finally:
        stop_writer.set()
        if gateway is not None:
            gateway.stop()
        link.close()
        db.drop()


# Redis outage ----------------------------------------------------------------------------------
def _redis_reachable() -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _redis_reachable(), reason="no Redis at 127.0.0.1:6379")
@pytest.mark.reliability
def test_redis_cut_fails_closed_and_concurrency_holds_across_two_gateways(stack: Stack, tmp_path, figures) -> None:
    """Two ``kvgate serve`` share Redis admission through a link we cut for 5 s while 8 clients
    stream through both: admission fails closed (503 ``admission_unavailable``, never a 500),
    streams admitted before the cut finish, the tenant never has more requests at the engine
    than its limit, and after the restore requests are admitted again and no lease is left."""
    import redis

    proxy, proxy_port, stop_proxy = run_counting_proxy_in_thread(f"127.0.0.1:{stack.engine.port}")
    link = TcpCut(6379).start()
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", pepper=PEPPER)
    registry.add_pool("reference", f"127.0.0.1:{proxy_port}")
    registry.add_class()
    slug = "redis-cut-" + secrets.token_hex(3)
    limit = 3
    key = registry.add_tenant(slug, pool="reference", max_concurrent_requests=limit)
    env = {"KVGATE_REDIS_URL": f"redis://127.0.0.1:{link.port}/0"}
    gateways = [GatewayProcess(registry.url, PEPPER, tmp_path / f"gw{i}", extra_env=env) for i in range(2)]
    stop = threading.Event()
    lock = threading.Lock()
    outcomes: list[tuple[float, int, str, bool]] = []  # (time, status, error code, stream complete)
    try:
        for g in gateways:
            g.start()
        for g in gateways:
            g.wait_ready()

        def client(i: int) -> None:
            gateway = gateways[i % 2]
            body = chat_body([{"role": "user", "content": f"Count to ten, voice {i}."}], max_tokens=12)
            with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
                while not stop.is_set():
                    result = StreamResult(0)
                    parser = SseParser(result)
                    with http.stream("POST", "/v1/chat/completions", headers=auth(key), json=body) as r:
                        result.status = r.status_code
                        if r.status_code == 200:
                            for line in r.iter_lines():
                                parser.line(line)
                            code = ""
                        else:
                            raw = r.read()
                            try:
                                code = json.loads(raw)["error"]["code"]
                            except (ValueError, KeyError, TypeError):
                                code = f"unparsable: {raw[:120]!r}"
                    with lock:
                        outcomes.append((time.monotonic(), result.status, code, result.complete))
                    if r.status_code != 200:
                        time.sleep(0.2)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(3)
        link.cut()
        cut_at = time.monotonic()
        time.sleep(5)
        link.restore()
        restored_at = time.monotonic()
        time.sleep(5)
        stop.set()
        for t in threads:
            t.join(60)
        statuses = {(s, c) for _, s, c, _ in outcomes}
        assert statuses <= {(200, ""), (429, "rate_limit_exceeded"), (503, "admission_unavailable")}, statuses
        during = [(s, c) for at, s, c, _ in outcomes if cut_at + 0.5 < at < restored_at]
        assert (503, "admission_unavailable") in during
        assert all(ok for _, s, _, ok in outcomes if s == 200), "a stream admitted before the cut did not finish"
        after = [s for at, s, _, _ in outcomes if at > restored_at + 2]
        assert 200 in after, "admission did not come back after Redis did"
        engine_max = max(proxy.max_in_flight.values())
        assert engine_max <= limit, proxy.max_in_flight
        leases = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        wait_for(lambda: leases.zcard(f"kvgate:adm:{{{slug}}}:leases") == 0, 10, "every lease to be given back")
        figures.record("faults: Redis cut 5 s, two gateways", limit=limit, engine_max_in_flight=engine_max,
                       answered_200=sum(1 for _, s, _, _ in outcomes if s == 200),
                       refused_503_admission_unavailable=sum(1 for _, s, _, _ in outcomes if s == 503),
                       refused_429=sum(1 for _, s, _, _ in outcomes if s == 429),
                       answered_200_during_cut=sum(1 for at, s, _, _ in outcomes if cut_at < at < restored_at and s == 200),
                       leases_left_after=0)
    finally:
        stop.set()
        for g in gateways:
            g.stop()
        link.close()
        stop_proxy()
