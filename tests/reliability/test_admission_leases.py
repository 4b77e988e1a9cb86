"""A SIGKILLed gateway's Redis admission leases return within one lease TTL.

``kvgate serve`` on Redis admission with a short lease TTL (``KVGATE_ADMISSION_LEASE_TTL_S``)
holds every concurrency slot of a tenant with streams that live several TTLs (a fixed
engine paced slowly). Asserted: while the gateway lives, the heartbeat keeps renewing the
leases (each is still in Redis after its first expiry has passed on Redis' clock, with a
later expiry), so a long request keeps its slot; after a SIGKILL no lease expires later
than one TTL after the kill (on Redis' clock), and once that moment has passed a second
gateway is admitted for every slot of the tenant at once.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.reliability.harness import ROOT, GatewayProcess, Registry
from tests.reliability.sse import SseParser, StreamResult, chat_body
from tests.reliability.test_faults import _redis_reachable
from tests.server.gateway.stack import PEPPER, free_port

LEASE_TTL_S = 3.0
LIMIT = 3


def _redis_now(r) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


def _wait_redis_clock_past(r, moment: float, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while _redis_now(r) <= moment:
        assert time.monotonic() < deadline, "Redis' clock did not advance"
        time.sleep(0.05)


@pytest.mark.skipif(not _redis_reachable(), reason="no Redis at 127.0.0.1:6379")
@pytest.mark.reliability_full
def test_sigkilled_gateways_leases_lapse_within_one_ttl_and_live_ones_are_renewed(tmp_path, figures) -> None:
    import redis

    port = free_port()
    engine = subprocess.Popen([sys.executable, str(ROOT / "bench" / "server" / "fixed_engine.py"), "--port", str(port),
                               "--tokens", "40", "--token-delay-ms", "300"],
                              stdout=open(tmp_path / "engine.log", "ab"), stderr=subprocess.STDOUT, cwd=ROOT)
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", pepper=PEPPER)
    registry.add_pool("fixed", f"127.0.0.1:{port}")
    registry.add_class()
    slug = "leases-" + secrets.token_hex(3)
    key = registry.add_tenant(slug, pool="fixed", max_concurrent_requests=LIMIT)
    env = {"KVGATE_REDIS_URL": "redis://127.0.0.1:6379/0", "KVGATE_ADMISSION_LEASE_TTL_S": str(LEASE_TTL_S)}
    first, second = (GatewayProcess(registry.url, PEPPER, tmp_path / f"gw{i}", extra_env=env) for i in range(2))
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    zset = f"kvgate:adm:{{{slug}}}:leases"
    try:
        first.start(timeout=300)  # a shared 2-core machine can take minutes to import
        first.wait_ready()

        def long_stream() -> None:  # 40 tokens 300 ms apart: ~12 s, four lease TTLs
            body = chat_body([{"role": "user", "content": "Tell a long story."}], max_tokens=40)
            try:
                with httpx.stream("POST", first.base_url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}, timeout=120) as resp:
                    for _ in resp.iter_lines():
                        pass
            except httpx.HTTPError:
                pass  # the SIGKILL cuts it

        holders = [threading.Thread(target=long_stream, daemon=True) for _ in range(LIMIT)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 120
        while r.zcard(zset) < LIMIT:
            assert time.monotonic() < deadline, "the streams never held every slot"
            time.sleep(0.05)
        granted = dict(r.zrange(zset, 0, -1, withscores=True))
        _wait_redis_clock_past(r, max(granted.values()))  # every lease's first expiry is past ...
        renewed = dict(r.zrange(zset, 0, -1, withscores=True))
        assert set(renewed) == set(granted), "a live request lost its lease"  # ... yet they are all there,
        assert all(renewed[k] > granted[k] for k in granted)  # renewed by the heartbeat
        assert all(t.is_alive() for t in holders), "the streams ended before the check"

        first.signal(signal.SIGKILL)
        first.wait(10)
        killed_at = _redis_now(r)
        held = dict(r.zrange(zset, 0, -1, withscores=True))
        assert len(held) == LIMIT  # the dead gateway's slots, still held
        latest = max(held.values())
        assert latest <= killed_at + LEASE_TTL_S, (latest - killed_at, LEASE_TTL_S)

        second.start(timeout=300)
        second.wait_ready()
        _wait_redis_clock_past(r, latest)
        free_after = round(latest - killed_at, 2)
        assert r.zcount(zset, f"({_redis_now(r)}", "+inf") == 0  # no slot held any more
        statuses: list[int] = []
        lock = threading.Lock()

        def short_stream() -> None:
            result = StreamResult(0)
            parser = SseParser(result)
            body = chat_body([{"role": "user", "content": "Hi."}], max_tokens=3)
            with httpx.stream("POST", second.base_url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=60) as resp:
                result.status = resp.status_code
                for line in resp.iter_lines():
                    parser.line(line)
            with lock:
                statuses.append(200 if result.complete else result.status)

        barrier = [threading.Thread(target=short_stream) for _ in range(LIMIT)]
        for t in barrier:
            t.start()
        for t in barrier:
            t.join(60)
        assert statuses == [200] * LIMIT, statuses  # every slot of the tenant, at once, on the other gateway
        figures.record("admission: SIGKILLed gateway's leases", lease_ttl_s=LEASE_TTL_S, slots=LIMIT,
                       renewed_while_live=len(renewed), latest_expiry_after_kill_s=free_after,
                       admitted_at_once_after=len(statuses))
    finally:
        for g in (first, second):
            g.stop()
        if engine.poll() is None:
            engine.kill()
        engine.wait(10)
        r.delete(zset)
