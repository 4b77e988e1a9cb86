"""Load: concurrent streams from several tenants, limits checked at the engine.

The scenario is ``bench/reliability/load.py``'s (one implementation): ``kvgate serve`` in its own
process, the reference engine behind a counting proxy, tenants with concurrency limits
below their share of the burst, 429 ``max_concurrent`` answers retried by the clients.
The fast subset bursts 40 streams; the full suite 200, once through one
gateway and once through two ``kvgate serve`` replicas sharing Redis admission (the
limits must hold across replicas, still checked at the engine).
"""

from __future__ import annotations

import socket

import pytest

from bench.reliability.load import run_load
from tests.server.gateway.stack import Stack

RSS_GROWTH_BOUND_MIB = 64  # a burst may warm caches; a per-request leak of even 300 KiB x 200 would exceed it


def redis_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(("requests", "replicas"), [
    pytest.param(40, 1, marks=pytest.mark.reliability, id="40"),
    pytest.param(200, 1, marks=pytest.mark.reliability_full, id="200"),
    pytest.param(200, 2, marks=[pytest.mark.reliability_full,
                                pytest.mark.skipif(not redis_reachable(), reason="no Redis at 127.0.0.1:6379")],
                 id="200-two-replicas-redis"),
])
async def test_concurrent_streams_are_complete_correct_and_within_limits(stack: Stack, tmp_path, requests: int,
                                                                        replicas: int, figures) -> None:
    report = await run_load(engine_port=stack.engine.port, workdir=tmp_path, requests=requests, tenants=4,
                            max_tokens=4, replicas=replicas,
                            redis_url="redis://127.0.0.1:6379/0" if replicas > 1 else None)
    figures.record(f"load: {requests} concurrent streams, 4 tenants, {replicas} gateway(s) ({report.admission} admission)", **{
        k: (round(v, 2) if isinstance(v, float) else v) for k, v in report.as_dict().items()})
    assert report.errors == []
    assert report.incomplete == 0 and report.wrong_text == 0
    assert report.completed == requests
    for slug, limit in report.limits.items():
        assert 1 <= report.engine_max_in_flight[slug] <= limit, (slug, report.engine_max_in_flight)
        assert report.engine_requests[slug] == requests // 4  # one engine call per stream, none lost or doubled
    assert report.rss_after_mib - report.rss_before_mib < RSS_GROWTH_BOUND_MIB * replicas
