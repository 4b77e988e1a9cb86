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

def _pool(name: str = "p", *, primary: int = 64, secondary: int = 0, tpb: int = 16,  # noqa: ANN202
          replicas: tuple[str, ...] = ()):
    """``replicas``: one registry state per replica (none: the count defaults to 1)."""
    from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

    reps = tuple(ReplicaSnapshot(i + 1, f"r{i}", f"h:{i}", state, 1) for i, state in enumerate(replicas))
    return PoolSnapshot(1, name, "m", "t", "ref", tpb, primary, secondary, 30, reps)


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


def _shadow_blocks(curve) -> list[tuple[int, int]]:  # noqa: ANN001
    """Each point's shadow blocks (GPU without the transient tail slot, host)."""
    return [(p.shadow.pool.config.primary_blocks - 1, p.shadow.pool.config.secondary_blocks) for p in curve.points]


def _scrape(curves) -> str:  # noqa: ANN001
    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observe.miss_ratio import MissRatioCollector

    registry = CollectorRegistry()
    registry.register(MissRatioCollector(curves, lambda pool: {}))
    return generate_latest(registry).decode()


def test_a_small_pool_at_the_default_rate_keeps_distinct_points() -> None:
    """100 blocks at 1 %: the 0.5x and 1x shadows were one block each (one figure twice, a 2x of
    2 blocks); the pool's rate is raised so the smallest point keeps its floor, every point
    its own size, and the points model their labels' capacities."""
    from server.gateway.observe.miss_ratio import MIN_SHADOW_BLOCKS, MissRatioCurves

    curves = MissRatioCurves(0.01)
    _observe(curves, _pool(primary=100, secondary=300))
    curve = curves.curves()["p"]
    sizes = _shadow_blocks(curve)
    assert len(set(sizes)) == len(sizes) == 6
    assert min(g for g, _ in sizes) >= MIN_SHADOW_BLOCKS and min(h for _, h in sizes if h) >= MIN_SHADOW_BLOCKS
    assert curve.sample.rate == MIN_SHADOW_BLOCKS / 50
    modeled = {(p.gpu, p.host): (p.shadow.primary_blocks, p.shadow.secondary_blocks) for p in curve.points}
    assert modeled == {("0.5x", "1x"): (50, 300), ("1x", "1x"): (100, 300), ("2x", "1x"): (200, 300),
                       ("4x", "1x"): (400, 300), ("1x", "0x"): (100, 0), ("1x", "2x"): (100, 600)}
    text = _scrape(curves)
    assert f'kvgate_mrc_sample_rate{{pool="p"}} {MIN_SHADOW_BLOCKS / 50}' in text
    # A large pool keeps the configured rate.
    assert MissRatioCurves(0.01).curve(_pool("big", primary=100_000)).sample.rate == 0.01


def test_a_raised_rate_needs_no_correction_in_the_estimate() -> None:
    """The estimate is kept hits / kept references × the exact full-block share: a prompt sent
    twice reads half its full-block tokens at every point, whatever the pool's rate."""
    from server.gateway.observe.miss_ratio import MissRatioCurves

    import numpy as np

    from retention.hashing import block_hashes
    from retention.types import DEFAULT_PLAN

    curves = MissRatioCurves(0.01)
    pool = _pool(primary=100)
    hashes = block_hashes(np.arange(40 * 16, dtype=np.int32), 16, salt=None)  # fits the smallest shadow
    for now in (0.0, 1.0):
        curves.observe(pool, hashes, DEFAULT_PLAN, now=now, num_tokens=40 * 16 + 1, tenant="1")
    curve = curves.curves()["p"]
    assert curve.sample.rate > 0.01
    expected = 40 * 16 / (2 * (40 * 16 + 1))
    assert all(p.shadow.counts.kept_blocks for p in curve.points)
    assert all(abs(p.shadow.counts.hit_rate() - expected) < 1e-12 for p in curve.points)


def test_points_even_rate_one_cannot_separate_are_left_out() -> None:
    """A 1-block pool: 0.5x would be the 1x shadow again; a host tier of a few blocks beside a
    large GPU tier (the rate's raise capped by MAX_SHADOW_BLOCKS): host 2x would be host 1x's.
    Those points are not built, so no series repeats another's figure; 1x/1x is always there."""
    from server.gateway.observe.miss_ratio import MAX_SHADOW_BLOCKS, MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool("one", primary=1))
    assert [(p.gpu, p.host) for p in curves.curves()["one"].points] == [("1x", "1x"), ("2x", "1x"), ("4x", "1x")]

    curves = MissRatioCurves(0.01)
    _observe(curves, _pool("lopsided", primary=100_000, secondary=10))
    curve = curves.curves()["lopsided"]
    sizes = _shadow_blocks(curve)
    assert len(set(sizes)) == len(sizes)
    assert ("1x", "2x") not in [(p.gpu, p.host) for p in curve.points]
    assert ("1x", "1x") in [(p.gpu, p.host) for p in curve.points]
    assert sum(g + 1 + h for g, h in sizes) <= MAX_SHADOW_BLOCKS + len(sizes)  # the raise stays within the budget
    text = _scrape(curves)
    assert 'gpu="1x",host="2x"' not in text and 'gpu="1x",host="1x",pool="lopsided"' in text


def test_points_model_the_pools_serving_replicas_together() -> None:
    """The registration is per replica and the shadows see the whole pool's traffic, so the 1x
    point is the serving (not disabled) replicas' combined blocks, and kvgate_mrc_blocks says so."""
    from server.gateway.observe.miss_ratio import MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool(primary=64, secondary=128, replicas=("active", "draining", "disabled")))
    curve = curves.curves()["p"]
    modeled = {(p.gpu, p.host): (p.shadow.primary_blocks, p.shadow.secondary_blocks) for p in curve.points}
    assert modeled[("1x", "1x")] == (128, 256)
    assert curve.replicas == 2
    assert modeled[("0.5x", "1x")] == (64, 256) and modeled[("4x", "1x")] == (512, 256)
    assert modeled[("1x", "2x")] == (128, 512)
    text = _scrape(curves)
    assert 'kvgate_mrc_blocks{gpu="1x",host="1x",pool="p",tier="primary"} 128.0' in text
    assert 'kvgate_mrc_replicas{pool="p"} 2.0' in text


def test_a_replica_count_change_starts_a_fresh_curve() -> None:
    from server.gateway.observe.miss_ratio import MissRatioCurves

    curves = MissRatioCurves(1.0)
    _observe(curves, _pool(replicas=("active", "disabled")))
    before = curves.curves()["p"]
    _observe(curves, _pool(replicas=("draining", "disabled")), now=1.0)  # a drain passing: still one serving
    assert curves.curves()["p"] is before
    _observe(curves, _pool(replicas=("active", "draining")), now=2.0)
    after = curves.curves()["p"]
    assert after is not before and after.points[1].shadow.primary_blocks == 128
    assert after.points[1].shadow.counts.requests == 1  # this request only
