"""Online miss-ratio curves on a live gateway (the stack samples every block: rate 1.0).

With every block kept, a shadow at the pool's own size is the pool's cache model, so the
figures can be checked by hand: a fresh salted tenant sends the same prompt twice; its
first request hits nothing, its second hits every full block of the prompt, so its
estimated prompt-token hit rate is ``full_blocks × tokens_per_block / (2 × prompt_tokens)``
at every capacity that holds the prompt.
"""

from __future__ import annotations

import secrets
import time

import httpx

from tests.server.gateway.stack import Stack
from tests.server.gateway.test_openai_e2e import client, metric, system_prompt


def test_curves_estimate_a_repeated_prompt_exactly(stack: Stack) -> None:
    slug = "mrc-" + secrets.token_hex(3)
    key = stack.add_tenant(slug, kv_quota_fraction=1.0)
    messages = [{"role": "system", "content": system_prompt(slug)}, {"role": "user", "content": "Capital of Peru?"}]
    usages = []
    for _ in range(2):
        done = client(stack, key).chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                                          max_tokens=2, temperature=0)
        usages.append(done.usage.prompt_tokens)
    assert usages[0] == usages[1]
    prompt = usages[0]
    full = prompt // stack.tokens_per_block
    expected = full * stack.tokens_per_block / (2 * prompt)

    deadline = time.monotonic() + 15  # the tenant's slug appears with the next registry poll
    while metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu="1x", host="1x") == 0.0:
        assert time.monotonic() < deadline, "no per-tenant miss-ratio series"
        time.sleep(0.3)
    for gpu in ("0.5x", "1x", "2x", "4x"):
        assert abs(metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu=gpu, host="1x") - expected) < 1e-9
    # GPU alone holds the prompt, so the host tier adds nothing for this tenant.
    assert abs(metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu="1x", host="0x") - expected) < 1e-9
    # Pool-wide points exist for every capacity, with their sizes.
    assert metric(stack, "kvgate_mrc_blocks", pool="reference", gpu="2x", host="1x", tier="primary") == 512
    assert metric(stack, "kvgate_mrc_blocks", pool="reference", gpu="1x", host="0x", tier="secondary") == 0
    assert 0.0 < metric(stack, "kvgate_mrc_hit_rate", pool="reference", gpu="4x", host="1x") <= 1.0
    # Each estimate carries its jackknife standard error (the prompt's blocks span several groups).
    text = httpx.get(stack.gateway.base_url + "/metrics").text
    errors = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvgate_mrc_hit_rate_stderr{") and 'pool="reference"' in line]
    assert len(errors) == 6 and all(0.0 <= e < 0.5 for e in errors), errors


# --- units: no stack ------------------------------------------------------------------------

def _pool(name: str = "p", *, primary: int = 64, secondary: int = 0, tpb: int = 16):  # noqa: ANN202
    from tenants.snapshots import PoolSnapshot

    return PoolSnapshot(1, name, "m", "t", "ref", tpb, primary, secondary, 30, ())


def _observe(curves, pool, *, tenant: str = "1", now: float = 0.0) -> None:  # noqa: ANN001
    import numpy as np

    from retention.hashing import block_hashes
    from retention.types import DEFAULT_PLAN

    toks = np.arange(4 * pool.tokens_per_block, dtype=np.int32)
    curves.observe(pool, block_hashes(toks, pool.tokens_per_block, salt=None), DEFAULT_PLAN, now=now,
                   num_tokens=len(toks) + 1, tenant=tenant)


def test_a_scrape_survives_pools_and_tenants_added_while_it_runs() -> None:
    """/metrics is a sync route (a worker thread) while the event loop adds pools and tenants: the
    collector reads copies, so a new pool or tenant mid-scrape does not fail the scrape."""
    from collections.abc import Mapping

    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.miss_ratio import MissRatioCollector, MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool("a"))
    added: list[str] = []

    class Slugs(Mapping):  # each lookup lands while the collector walks the curves and their tenants
        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            added.append(key)
            _observe(curves, _pool("a"), tenant=f"new{len(added)}", now=len(added))
            return "tenant-" + key

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(())

        def __len__(self) -> int:
            return 0

    def slugs(pool: str) -> Mapping[str, str]:
        _observe(curves, _pool(f"new-pool-{len(curves.curves())}"))
        return Slugs()

    registry = CollectorRegistry()
    registry.register(MissRatioCollector(curves, slugs))
    text = generate_latest(registry).decode()
    assert 'pool="a"' in text and added


def test_curves_of_pools_no_longer_listed_are_dropped() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.miss_ratio import MissRatioCollector, MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool("old"))
    _observe(curves, _pool("kept"))
    registry = CollectorRegistry()
    registry.register(MissRatioCollector(curves, lambda pool: {}))
    assert 'pool="old"' in generate_latest(registry).decode()
    curves.retain({"kept", "not-seen-yet"})
    assert set(curves.curves()) == {"kept"}
    text = generate_latest(registry).decode()
    assert 'pool="old"' not in text and 'pool="kept"' in text


def test_the_pool_monitor_drops_the_curve_of_a_pool_the_registry_no_longer_lists() -> None:
    import asyncio

    from server.gateway.observe.miss_ratio import MissRatioCurves
    from server.gateway.replicas.engines import EngineDirectory
    from server.gateway.replicas.pool_monitor import PoolMonitor

    curves = MissRatioCurves(1.0)
    listings: list[object] = [[], RuntimeError("registry away")]
    _observe(curves, _pool("gone"))

    def listing():  # type: ignore[no-untyped-def]
        item = listings.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    monitor = PoolMonitor(EngineDirectory(lambda pool: None), listing, curves=curves)
    asyncio.run(monitor.refresh())  # deleted from the registry
    assert curves.curves() == {}
    _observe(curves, _pool("raced"))
    asyncio.run(monitor.refresh())  # the registry is away: nothing is forgotten
    assert set(curves.curves()) == {"raced"}


def test_a_block_size_change_starts_a_fresh_curve() -> None:
    from server.gateway.observe.miss_ratio import MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool(tpb=16))
    before = curves.curves()["p"]
    _observe(curves, _pool(tpb=16), now=1.0)
    assert curves.curves()["p"] is before
    _observe(curves, _pool(tpb=32), now=2.0)
    assert curves.curves()["p"] is not before
