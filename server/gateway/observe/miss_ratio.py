"""Online miss-ratio curves per pool: what more (or fewer) GPU and host blocks would buy.

Each pool gets a handful of sampled shadow pools (``retention.shadow``: SHARDS spatial
sampling, the real ``BlockPool`` at ``capacity × rate`` blocks) fed every request's block
hashes with the plan it really got — quota demotion, SLO rollback and adaptive bands
included — so the estimate answers "this traffic, these plans, another size". The sizes are
the pool's *fleet*: the registered ``primary_blocks`` / ``secondary_blocks`` are per replica
(``capacity_check.py``), and every point is fed the whole pool's traffic, so a point's
capacity is ``n × registered`` with ``n`` the pool's replicas not ``disabled`` (a draining one
counts: drains pass; at least 1)::

    point      GPU blocks               host blocks
    gpu 0.5x   0.5 × n × registered     n × registered
    gpu 1x     n × registered           n × registered     ← today's fleet (a check on the estimate)
    gpu 2x     2 × n × registered       n × registered
    gpu 4x     4 × n × registered       n × registered
    host 0x    n × registered           0                  ← what the host tier buys today
    host 2x    n × registered           2 × n × registered (pools with a host tier only)

One shadow of ``n × C`` blocks is an approximation of ``n`` replicas of ``C``: it is what a
KV-aware router approaches (each prefix served where it is cached, the replicas' caches
holding mostly different prefixes); replicas holding copies of one prefix, or a router that
ignores the cache, hit less than the point says. Compare the 1x point with the pool's
measured hit rate with that in mind; with one replica it is the pool itself.

Sampling rate per pool (SHARDS' fixed-size idea, bounded). At the configured ``rate`` a small
pool's shadows are a few blocks: 100 blocks at 1 % gave the 0.5x and 1x points one block
each, the same shadow and the same figure, and nothing in the stderr said so. So each curve
samples at ``max(rate, MIN_SHADOW_BLOCKS / smallest point)`` per tier (the 0.5x GPU point,
the 1x host point), capped at 1.0 and so that a raise never takes the pool's shadows past
``MAX_SHADOW_BLOCKS`` in all (the configured rate alone may). ``MIN_SHADOW_BLOCKS`` is about
resolution, not fidelity: at 16 the smallest point models its label's capacity within 1/32
and every point has its own size (bench:mrc's 4-block 0.5x shadow at 1 % was within its
stated error). The estimate is the ratio kept hits / kept references (``ShadowCounts``), so it
needs no correction for the rate; ``kvgate_mrc_sample_rate{pool}`` says which one a curve uses.

What is exported. A shadow holds ``round(capacity × rate)`` blocks, so it models
``blocks / rate``, which is what ``kvgate_mrc_blocks`` reports (equal to the table's figure
within rounding once the rate is raised; it is the fleet's total, and ``kvgate_mrc_replicas``
gives ``n``). A point whose shadow would have the same blocks as another point's (a host
tier of a handful of blocks, a pool of 1 block even at rate 1.0) is not built: its figure
would be a copy, so its series are absent (the 1x/1x point is always kept). Series:
``kvgate_mrc_hit_rate{pool, gpu, host}`` (estimated prompt-token hit rate),
``kvgate_mrc_hit_rate_stderr{…}`` (its jackknife standard error: read the point as ± 2 of
these), ``kvgate_mrc_host_hit_rate{…}``, ``kvgate_mrc_blocks{pool, gpu, host, tier}``,
``kvgate_tenant_mrc_hit_rate{tenant, pool, gpu, host}`` for tenants with samples, and per
pool ``kvgate_mrc_sample_rate`` and ``kvgate_mrc_replicas``.

Bounds: per pool the shadows hold ``r × Σ points`` blocks, Σ points ≈ n × (9.5 × primary + 6 ×
host), r the pool's rate: at most ``max(rate × Σ points, MAX_SHADOW_BLOCKS)``; CPU per request
one pass over its hashes plus the kept blocks' replay in each shadow, the kept share being r
(measured in docs/benchmarks.md, ``bench:mrc``, at fixed rates). A pool whose shape
(block counts, offload threshold, block size or serving replica count) changes starts a fresh
curve; a request whose tenant snapshot is older than another's (the auth cache, a few
seconds) may restart it more than once until they agree. The pool monitor drops the curves
of pools the registry no longer lists (``retain``).
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
MIN_SHADOW_BLOCKS = 16  # the smallest non-zero point of each tier holds at least this many (rate permitting)
MAX_SHADOW_BLOCKS = 1 << 14  # ... unless the raise would take a pool's shadows past this in all


@dataclass(slots=True)
class _Point:
    """One capacity; ``shadow.primary_blocks`` / ``secondary_blocks`` are what it models (fleet
    blocks: shadow blocks / the curve's rate)."""

    gpu: str
    host: str
    shadow: ShadowPool


def replica_count(pool: PoolSnapshot) -> int:
    """The pool's serving replicas: those not ``disabled`` (at least 1). A ``draining`` replica
    counts: a drain is passing (a rolling restart drains each replica in turn) and would otherwise
    restart the curve twice per replica."""
    return max(1, sum(r.state != "disabled" for r in pool.replicas))


def _shape(pool: PoolSnapshot) -> tuple[int, int, int, int, int]:
    """What a curve is built for: a change to any of these starts a fresh one (a new block size
    changes every block hash and the tokens each block weighs; a new replica count, every size)."""
    return (pool.primary_blocks, pool.secondary_blocks, pool.secondary_offload_min_priority, pool.tokens_per_block,
            replica_count(pool))


def curve_rate(rate: float, targets: Sequence[tuple[int, int]]) -> float:
    """The sampling rate for a curve of ``(gpu, host)`` capacities: ``rate``, raised so each
    tier's smallest non-zero capacity keeps ``MIN_SHADOW_BLOCKS``, the raise capped at 1.0 and at
    ``MAX_SHADOW_BLOCKS`` shadow blocks in all. ``rate`` must be within (0, 1]."""
    need = rate
    for tier in (0, 1):
        smallest = min((t[tier] for t in targets if t[tier] > 0), default=0)
        if smallest:
            need = max(need, MIN_SHADOW_BLOCKS / smallest)
    total = sum(g + h for g, h in targets)
    return min(1.0, max(rate, min(need, MAX_SHADOW_BLOCKS / max(total, 1))))


@dataclass(slots=True)
class PoolCurve:
    """The shadow points of one pool; ``shape`` is the registry shape they were built for.

    Invariants: no two points' shadows have the same (GPU, host) blocks; the point labelled
    ``1x``/``1x`` exists; points keep the ``GPU_SCALES`` then ``HOST_SCALES`` order."""

    shape: tuple[int, int, int, int, int]  # primary, secondary, offload threshold, tokens per block, replicas
    sample: HashSample
    replicas: int = 1
    points: list[_Point] = field(default_factory=list)

    @classmethod
    def build(cls, pool: PoolSnapshot, rate: float) -> PoolCurve:
        replicas = replica_count(pool)
        primary, secondary = replicas * pool.primary_blocks, replicas * pool.secondary_blocks
        targets = [(label, "1x", max(1, round(primary * scale)), secondary) for label, scale in GPU_SCALES]
        if secondary > 0:
            targets += [("1x", label, primary, round(secondary * scale)) for label, scale in HOST_SCALES]
        sample = HashSample(curve_rate(rate, [(g, h) for _, _, g, h in targets]))
        curve = cls(_shape(pool), sample, replicas)
        # Today's fleet first, so a point that collides with it is the one left out.
        order = sorted(range(len(targets)), key=lambda i: targets[i][:2] != ("1x", "1x"))
        kept: dict[int, tuple[int, int]] = {}
        for i in order:
            blocks = (sample.scale(targets[i][2]), sample.scale(targets[i][3]))
            if blocks not in kept.values():
                kept[i] = blocks
        for i in sorted(kept):
            gpu_label, host_label = targets[i][:2]
            # The capacity the shadow models; ShadowPool scales it back to exactly ``blocks``
            # (|round(b / r) × r - b| <= r / 2 < 1/2 for r < 1; exact at r = 1).
            gpu, host = (round(b / sample.rate) for b in kept[i])
            shadow = ShadowPool(sample, gpu, host, pool.secondary_offload_min_priority)
            curve.points.append(_Point(gpu_label, host_label, shadow))
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
        blocks = GaugeMetricFamily("kvgate_mrc_blocks", "Capacity a miss-ratio-curve point models: blocks over "
                                   "all the pool's serving replicas (its shadow's blocks / the sample rate)",
                                   labels=labels + ["tier"])
        sample_rate = GaugeMetricFamily("kvgate_mrc_sample_rate", "Share of the block-hash space a pool's curve "
                                        "samples (the configured rate, raised for small pools)", labels=["pool"])
        replicas = GaugeMetricFamily("kvgate_mrc_replicas", "Serving (not disabled) replicas a pool's curve is sized for (the "
                                     "points model their combined blocks)", labels=["pool"])
        tenant_hit = GaugeMetricFamily("kvgate_tenant_mrc_hit_rate", "Estimated prompt-token hit rate of one tenant "
                                       "at this pool capacity", labels=["tenant"] + labels)
        # Copies: the scrape runs in a worker thread while the event loop adds pools and tenants.
        for pool, curve in list(self._curves.curves().items()):
            slugs = self._tenant_slugs(pool)
            sample_rate.add_metric([pool], curve.sample.rate)
            replicas.add_metric([pool], curve.replicas)
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
        yield sample_rate
        yield replicas
        yield tenant_hit
