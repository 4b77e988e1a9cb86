"""Data safety: concurrent admin writes and a crash during usage flushes.

* 100 parallel PATCHes spread over 10 tenants through the admin API of ``kvgate serve``
  (clients retry a 409 with the fresh version, as the API asks): every write lands
  exactly once, versions advance by one per success with no gaps or repeats, the final
  row is the last success, and there is exactly one audit event per success.
* ``kvgate serve`` killed with SIGKILL while requests flow and usage batches flush every
  2 s: with the usage journal, the next start replays what the dead one left, so every
  request a client received in full is in the registry (0 lost) and nothing is counted
  twice (at most the requests the kill cut mid-answer are counted beyond them); so with
  ``KVGATE_USAGE_JOURNAL_SYNC=write`` (lines written, not fsynced: a SIGKILL leaves the
  kernel's page cache alone).
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import func, select

from tenants.models import AuditEvent, Tenant, Usage
from tests.reliability.harness import GatewayProcess, PostgresDatabase, Registry
from tests.reliability.sse import SseParser, StreamResult, chat_body
from tests.server.gateway.stack import PEPPER, Stack
from tests.tenants.fixtures import postgres_reachable

USAGE_FLUSH_S = 2.0  # LoopIntervals().usage_flush, what `kvgate serve` runs with


def _backend(kind: str, tmp_path):
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}", None
    if not postgres_reachable():
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not reachable")
    db = PostgresDatabase().create()
    return db.url, db


@pytest.mark.parametrize("backend", [
    pytest.param("sqlite", marks=pytest.mark.reliability),
    pytest.param("postgresql", marks=pytest.mark.reliability_full),
])
def test_100_parallel_admin_updates_leave_a_consistent_registry(stack: Stack, tmp_path, backend, figures) -> None:
    url, db = _backend(backend, tmp_path)
    gateway = None
    try:
        registry = Registry(url, pepper=PEPPER)
        registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
        registry.add_class()
        slugs = [f"w{i}" for i in range(10)]
        for slug in slugs:
            registry.add_tenant(slug, pool="reference")
        gateway = GatewayProcess(url, PEPPER, tmp_path / "gw")
        gateway.start()
        headers = {"Authorization": f"Bearer {gateway.admin_token}"}
        initial = {s: httpx.get(f"{gateway.base_url}/admin/v1/tenants/{s}", headers=headers).json()["version"]
                   for s in slugs}
        successes: list[tuple[str, int, int]] = []  # (slug, version after, value)
        errors: list[str] = []
        conflicts = 0
        lock = threading.Lock()

        def update(i: int) -> None:
            nonlocal conflicts
            slug, value = slugs[i % len(slugs)], 1000 + i
            with httpx.Client(base_url=gateway.base_url + "/admin/v1", headers=headers, timeout=60) as http:
                for _ in range(200):
                    version = http.get(f"/tenants/{slug}").json()["version"]
                    r = http.patch(f"/tenants/{slug}", json={"version": version, "rpm_limit": value})
                    if r.status_code == 200:
                        with lock:
                            successes.append((slug, r.json()["version"], value))
                        return
                    if r.status_code == 409:
                        with lock:
                            conflicts += 1
                        continue
                    with lock:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    return
                errors.append("gave up after 200 conflicts")

        with ThreadPoolExecutor(max_workers=20) as pool:
            list(pool.map(update, range(100)))
        assert errors == []
        assert len(successes) == 100
        with registry.factory() as session:
            tenants = {t.slug: t for t in session.scalars(select(Tenant).where(Tenant.slug.in_(slugs)))}
            events = session.scalars(select(AuditEvent).where(AuditEvent.action == "tenant.update")).all()
        for slug in slugs:
            mine = sorted((v, value) for s, v, value in successes if s == slug)
            assert [v for v, _ in mine] == list(range(initial[slug] + 1, initial[slug] + 1 + len(mine)))
            assert tenants[slug].version == initial[slug] + len(mine)
            assert tenants[slug].rpm_limit == mine[-1][1]
            audited = sorted((e.after or {}).get("rpm_limit") for e in events if e.entity_id == str(tenants[slug].id))
            assert audited == sorted(value for _, value in mine)
        assert len(events) == 100
        figures.record(f"data safety: 100 parallel admin updates ({backend})", successes=len(successes),
                       conflicts_retried=conflicts, errors=len(errors), audit_events=len(events),
                       lost_or_doubled_updates=0)
    finally:
        if gateway is not None:
            gateway.stop()
        if db is not None:
            db.drop()


def _usage_totals(registry: Registry, slug: str) -> tuple[int, int, int]:
    with registry.factory() as session:
        row = session.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                     func.coalesce(func.sum(Usage.prompt_tokens), 0),
                                     func.coalesce(func.sum(Usage.completion_tokens), 0))
                              .join(Tenant, Tenant.id == Usage.tenant_id).where(Tenant.slug == slug)).one()
        return int(row[0]), int(row[1]), int(row[2])


@pytest.mark.parametrize("sync", ["fsync", pytest.param("write", marks=pytest.mark.reliability_full)])
@pytest.mark.parametrize("backend", [
    pytest.param("sqlite", marks=pytest.mark.reliability),
    pytest.param("postgresql", marks=pytest.mark.reliability_full),
])
def test_sigkill_loses_no_answered_usage_and_replay_never_double_counts(
        stack: Stack, tmp_path, backend, sync, figures) -> None:
    """SIGKILL ``kvgate serve`` while 4 clients (2 streaming, 2 not) are answered; the next
    start replays the usage journal. Every answer a client received completely is in the
    registry (0 lost), and the registry holds no more than that plus the requests the kill
    cut mid-answer (whose usage may have been made durable just before their closing
    frames): 0 double counted, also after a final graceful restart."""
    url, db = _backend(backend, tmp_path)
    journal = tmp_path / "usage-journal"  # one volume, as across a pod's restarts
    env = {"KVGATE_USAGE_JOURNAL_DIR": str(journal), "KVGATE_USAGE_JOURNAL_SYNC": sync}
    gateways: list[GatewayProcess] = []
    kills = 2 if backend == "sqlite" else 3
    try:
        registry = Registry(url, pepper=PEPPER)
        registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
        registry.add_class()
        key = registry.add_tenant("metered", pool="reference", rpm_limit=100_000, max_concurrent_requests=64)
        headers = {"Authorization": f"Bearer {key}"}
        answered = [0, 0, 0]  # requests, prompt tokens, completion tokens the clients received in full
        cut = [0]  # requests whose answer the kill cut off
        rounds = []
        lock = threading.Lock()
        for round_ in range(kills):
            gateway = GatewayProcess(url, PEPPER, tmp_path / f"gw{round_}", extra_env=env)
            gateways.append(gateway)
            gateway.start()
            gateway.wait_ready()
            stop = threading.Event()
            mine = [0]
            endings: list[str] = []

            def client(i: int) -> None:
                stream = i % 2 == 0
                body = chat_body([{"role": "user", "content": f"Say a number, client {i}"}], max_tokens=3,
                                 stream=stream)
                with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
                    while not stop.is_set():
                        result = StreamResult(0)
                        try:
                            if stream:
                                parser = SseParser(result)
                                with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                                    result.status = r.status_code
                                    for line in r.iter_lines():
                                        parser.line(line)
                                usage, ok = result.usage, result.complete
                            else:
                                r = http.post("/v1/chat/completions", json=body, headers=headers)
                                usage, ok = r.json()["usage"], r.status_code == 200
                        except (httpx.HTTPError, ValueError, KeyError) as exc:
                            ok, why = False, repr(exc)[:200]
                        else:
                            why = f"{result.status if stream else r.status_code} {result.error if stream else r.text[:200]}"
                        with lock:
                            if ok:
                                answered[0] += 1
                                answered[1] += usage["prompt_tokens"]
                                answered[2] += usage["completion_tokens"]
                                mine[0] += 1
                            else:
                                cut[0] += 1
                                endings.append(why)
                                return  # the gateway is gone

            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while mine[0] < 8 and time.monotonic() < deadline:  # answers flowing (a loaded machine is slow)
                time.sleep(0.05)
            time.sleep((secrets.randbelow(1000) / 1000) * 2 * USAGE_FLUSH_S)  # then anywhere in a flush cycle
            gateway.signal(signal.SIGKILL)
            gateway.wait(10)
            stop.set()
            for t in threads:
                t.join(30)
            assert mine[0] > 0, endings  # the clients were answered before the kill
            rounds.append({"answered": mine[0], "journal_segments_left": len(list(journal.glob("usage-*.jsonl")))})
        # The next start replays what the last one left; a graceful stop flushes the rest.
        gateway = GatewayProcess(url, PEPPER, tmp_path / "gw-final", extra_env=env)
        gateways.append(gateway)
        gateway.start()
        gateway.wait_ready()
        gateway.signal(signal.SIGTERM)
        assert gateway.wait(40) == 0
        recorded = _usage_totals(registry, "metered")
        assert recorded[0] >= answered[0], ("lost", recorded, answered)
        assert recorded[1] >= answered[1] and recorded[2] >= answered[2], ("lost tokens", recorded, answered)
        assert recorded[0] <= answered[0] + cut[0], ("double counted", recorded, answered, cut)
        assert list(journal.glob("usage-*.jsonl")) == []  # all applied, all removed
        mode = backend if sync == "fsync" else f"{backend}, {sync}"  # the default keeps its section's name
        figures.record(f"data safety: SIGKILL with the usage journal ({mode})", kills=kills, rounds=rounds,
                       answered_in_full=answered[0], recorded_requests=recorded[0],
                       cut_by_the_kill=cut[0], recorded_of_the_cut=recorded[0] - answered[0],
                       lost=max(0, answered[0] - recorded[0]), double_counted=0,
                       prompt_tokens_answered_vs_recorded=[answered[1], recorded[1]],
                       completion_tokens_answered_vs_recorded=[answered[2], recorded[2]])
    finally:
        for gateway in gateways:
            gateway.stop()
        if db is not None:
            db.drop()
