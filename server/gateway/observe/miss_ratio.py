"""Online miss-ratio curves per pool: what more (or fewer) GPU and host blocks would buy.

Each pool gets a handful of sampled shadow pools (``retention.shadow``: SHARDS spatial
sampling, the real ``BlockPool`` at ``capacity × rate`` blocks) fed every request's block
hashes with the plan it really got — quota demotion, SLO rollback and adaptive bands
included — so the estimate answers "this traffic, these plans, another size"::

    point      GPU blocks           host blocks
    gpu 0.5x   0.5 × registered     registered
    gpu 1x     registered           registered     ← today's pool (a check on the estimate)
    gpu 2x     2 × registered       registered
    gpu 4x     4 × registered       registered
    host 0x    registered           0              ← what the host tier buys today
    host 2x    registered           2 × registered (pools with a host tier only)

Exported at scrape time as ``kvgate_mrc_hit_rate{pool, gpu, host}`` (estimated prompt-token
hit rate), ``kvgate_mrc_hit_rate_stderr{…}`` (its jackknife standard error: read the point
as ± 2 of these), ``kvgate_mrc_host_hit_rate{…}`` and ``kvgate_mrc_blocks{pool, gpu, host, tier}``,
plus ``kvgate_tenant_mrc_hit_rate{tenant, pool, gpu, host}`` for tenants with samples.

Bounds: memory Σ (C + H) × rate blocks per pool (about 0.05 × (9.5 × primary + 5 × host)
at the default rate); CPU per request one pass over its hashes plus the kept blocks' replay
in each shadow (measured in docs/benchmarks.md, ``bench:mrc``). A pool whose registered
shape (block counts, offload threshold or block size) changes starts a fresh curve; the pool
monitor drops the curves of pools the registry no longer lists (``retain``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from retention.shadow import HashSample, ShadowPool
from retention.types import RetentionPlan
from tenants.snapshots import PoolSnapshot

GPU_SCALES: tuple[tuple[str, float], ...] = (("0.5x", 0.5), ("1x", 1.0), ("2x", 2.0), ("4x", 4.0))
HOST_SCALES: tuple[tuple[str, float], ...] = (("0x", 0.0), ("2x", 2.0))


@dataclass(slots=True)
class _Point:
    gpu: str
    host: str
    shadow: ShadowPool


def _shape(pool: PoolSnapshot) -> tuple[int, int, int, int]:
    """What a curve is built for: a change to any of these starts a fresh one (a new block size
    changes every block hash and the tokens each block weighs)."""
    return (pool.primary_blocks, pool.secondary_blocks, pool.secondary_offload_min_priority, pool.tokens_per_block)


@dataclass(slots=True)
class PoolCurve:
    """The shadow points of one pool; ``shape`` is the registry shape they were built for."""

    shape: tuple[int, int, int, int]  # primary, secondary, offload threshold, tokens per block
    sample: HashSample
    points: list[_Point] = field(default_factory=list)

    @classmethod
    def build(cls, pool: PoolSnapshot, rate: float) -> PoolCurve:
        primary, secondary, threshold = pool.primary_blocks, pool.secondary_blocks, pool.secondary_offload_min_priority
        sample = HashSample(rate)
        curve = cls(_shape(pool), sample)
        for label, scale in GPU_SCALES:
            gpu = max(1, round(primary * scale))
            curve.points.append(_Point(label, "1x", ShadowPool(sample, gpu, secondary, threshold)))
        if secondary > 0:
            for label, scale in HOST_SCALES:
                curve.points.append(_Point("1x", label, ShadowPool(sample, primary, round(secondary * scale), threshold)))
        return curve

    def observe(self, hashes: Sequence[int], plan: RetentionPlan, *, now: float, num_tokens: int,
                tokens_per_block: int, tenant: str | None) -> None:
        kept = self.sample.indices(hashes)  # one filtering pass shared by every point
        for point in self.points:
            point.shadow.observe(hashes, plan, now=now, num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                                 tenant=tenant, kept=kept)


class MissRatioCurves:
    """Per-pool curves, created on a pool's first request. ``rate`` 0 disables them."""

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"miss-ratio-curve sampling rate must be within [0, 1], got {rate!r}")
        self.rate = rate
        self._curves: dict[str, PoolCurve] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    def curve(self, pool: PoolSnapshot) -> PoolCurve:
        curve = self._curves.get(pool.name)
        if curve is None or curve.shape != _shape(pool):
            curve = self._curves[pool.name] = PoolCurve.build(pool, self.rate)
        return curve

    def observe(self, pool: PoolSnapshot, hashes: Sequence[int], plan: RetentionPlan, *, now: float,
                num_tokens: int, tenant: str | None) -> None:
        if self.enabled:
            self.curve(pool).observe(hashes, plan, now=now, num_tokens=num_tokens,
                                     tokens_per_block=pool.tokens_per_block, tenant=tenant)

    def curves(self) -> Mapping[str, PoolCurve]:
        return self._curves

    def retain(self, listed: Collection[str]) -> None:
        """Drop the curves of pools not in ``listed`` (deleted or renamed in the registry): their
        shadows and ``kvgate_mrc_*`` series go. A request that raced the listing only starts a
        fresh curve for its pool."""
        for name in [n for n in self._curves if n not in listed]:
            del self._curves[name]


class MissRatioCollector(Collector):
    """Scrape-time gauges from the curves; ``tenant_slugs`` maps engine tenant ids to registry slugs."""

    def __init__(self, curves: MissRatioCurves, tenant_slugs: Callable[[str], Mapping[str, str]]) -> None:
        self._curves = curves
        self._tenant_slugs = tenant_slugs

    def describe(self):
        return []

    def collect(self):
        labels = ["pool", "gpu", "host"]
        hit = GaugeMetricFamily("kvgate_mrc_hit_rate", "Estimated prompt-token hit rate at this GPU/host capacity "
                                "(sampled shadow pools fed the live plans)", labels=labels)
        host_hit = GaugeMetricFamily("kvgate_mrc_host_hit_rate", "Estimated share of prompt tokens served from the "
                                     "host tier at this capacity", labels=labels)
        stderr = GaugeMetricFamily("kvgate_mrc_hit_rate_stderr", "Jackknife standard error of kvgate_mrc_hit_rate "
                                   "(over which blocks fell in the sample); ± 2 of these is a ~95 % interval",
                                   labels=labels)
        blocks = GaugeMetricFamily("kvgate_mrc_blocks", "Capacity of a miss-ratio-curve point (full-pool blocks)",
                                   labels=labels + ["tier"])
        tenant_hit = GaugeMetricFamily("kvgate_tenant_mrc_hit_rate", "Estimated prompt-token hit rate of one tenant "
                                       "at this pool capacity", labels=["tenant"] + labels)
        # Copies: the scrape runs in a worker thread while the event loop adds pools and tenants.
        for pool, curve in list(self._curves.curves().items()):
            slugs = self._tenant_slugs(pool)
            for point in curve.points:
                key = [pool, point.gpu, point.host]
                shadow = point.shadow
                blocks.add_metric(key + ["primary"], shadow.primary_blocks)
                blocks.add_metric(key + ["secondary"], shadow.secondary_blocks)
                rate = shadow.counts.hit_rate()
                if rate is None:
                    continue  # no sampled block yet: no estimate, not a zero
                hit.add_metric(key, rate)
                error = shadow.counts.hit_rate_stderr()
                if error is not None:
                    stderr.add_metric(key, error)
                host_hit.add_metric(key, shadow.counts.host_hit_rate() or 0.0)
                for tenant_id, counts in list(shadow.tenants.items()):
                    slug = slugs.get(tenant_id)
                    tenant_rate = counts.hit_rate()
                    if slug is not None and tenant_rate is not None:
                        tenant_hit.add_metric([slug] + key, tenant_rate)
        yield hit
        yield stderr
        yield host_hit
        yield blocks
        yield tenant_hit
