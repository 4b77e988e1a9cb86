"""Adaptive retention: bounded per-tenant reuse statistics of block-chain hashes → priorities.

The gateway hashes every prompt into block-chain hashes (``retention.hashing.block_hashes``
with the pool's ``tokens_per_block`` and the tenant's salt) and feeds them here; the
simulator's ``adaptive`` policy runs the same code.

Model. Per tenant we keep a size-bounded LRU map ``hash -> (uses, last_seen, shape)`` and
three families of counters, each turned into a probability with a Beta(1, 1) prior:

* ``p_c`` — a block used ``c`` times (c = 1, 2, 3, 4+) is used again within the horizon;
* ``p_shape`` — a *new conversation* (first block never seen) of this shape
  (``log2`` of its prompt blocks) comes back within the horizon;
* ``p_tail`` — a new block appended to a known prefix (a new turn's tail) is used again.

A block about to be reused for the ``c+1``-th time gets ``p_{c+1}``; a new block gets
``p_shape`` or ``p_tail``. The priority, relative to the pool's offload threshold ``T``,
combines that probability with the block's prior use count ``u``::

    p <  drop (1 %)              → 0          evicted first, dropped (never offloaded)
    u == 0                       → T          first use: first out of either tier
    u == 1                       → B          B = max(T+1, 36)
    u >= 2                       → B + 10     (``use_bands`` bands above T, ``band_step`` apart)

LRU orders blocks inside a band (TensorRT-LLM's eviction policy). Priorities never increase
along a chain (running minimum). A kept block's priority lasts for the horizon — the median
(``horizon_quantile``) of the tenant's observed reuse gaps, from a bounded reservoir — and
then falls back to 35, below every live kept band, so the blocks of finished conversations
do not hold a kept band forever (without durations a premium chat tenant next to a flood
kept 84 % of its solo hit rate instead of 90 %).

Why these bands: on the Mooncake synthetic trace the prior use count is the best online
predictor of a near return found — P(back within 30 s) is 2 % on a first use, 17 % after
one, 30–60 % after more — while finer levels by ``p`` and protecting reused blocks for
long horizons did worse than LRU (stale "hot" blocks crowd the cache; docs/benchmarks.md).
Sinking first uses also keeps one-shot traffic out of the way, which is what protects a
premium tenant from a flooding neighbour, whose unique prompts drive its ``p`` towards 0.

With a host tier (``adaptive_plan(..., host_tier=True)``, ``host_mode="recency"``): every
block at 35 except measured one-shot blocks (p < ``host_sink_probability``), which go to T
— offloaded, first out of either tier, never dropped. Offload keeps a block's priority and
clears its duration, so the kept bands above would become *permanent* host priorities:
on multi-turn chat the host filled with finished sessions and the hit rate fell from
75.4 % (TensorRT-LLM defaults) to 60.4 % at 2 % GPU + 4× host (docs/benchmarks.md).

Bounds: ``max_entries`` hashes per tenant (oldest forgotten first; a forgotten hash counts
as new), a fixed reservoir of gaps per tenant, O(blocks) work per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from retention.types import MAX_PRIORITY, RetentionPlan, merged_ranges

BUCKETS = 4  # use-count buckets: 1, 2, 3, 4+


def reservoir_add(reservoir: list[float], value: float, *, count: int, salt: int, size: int) -> bool:
    """Reservoir sampling (``count`` = values seen so far, this one included) with a deterministic slot.

    No RNG state, so runs are reproducible; ``salt`` (e.g. the block hash) spreads the slots.
    Returns whether ``value`` went in (False: the reservoir is unchanged).
    """
    if len(reservoir) < size:
        reservoir.append(value)
        return True
    slot = (salt ^ (count * 0x9E3779B1)) % count
    if slot < size:
        reservoir[slot] = value
        return True
    return False


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    max_entries: int = 200_000  # per tenant
    drop_probability: float = 0.01  # p below which a block gets priority 0 (dropped, never offloaded)
    use_bands: int = 2  # kept bands by prior use count: 1, 2, ..., use_bands or more
    band_step: int = 10  # priority distance between kept bands
    use_durations: bool = True  # kept blocks fall back to 35 after the horizon
    horizon_quantile: float = 0.5
    min_horizon_ms: int = 1_000
    max_horizon_ms: int = 3_600_000
    reservoir: int = 512  # reuse gaps kept per tenant for the horizon estimate
    # With a host tier (``adaptive_plan(..., host_tier=True)``), see ``priority_for``:
    # "recency" = 35 (LRU in both tiers) unless p < host_sink_probability, then T (offloaded,
    # first out of either tier); "host" = the GPU bands but one-shot blocks at T, not 0;
    # "default" = as "host" with first uses at max(T, 35); "gpu" = exactly the GPU-only bands.
    host_mode: str = "recency"
    host_sink_probability: float = 0.05

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.reservoir < 1:
            raise ValueError("max_entries and reservoir must be >= 1")
        if not 0.0 < self.horizon_quantile <= 1.0:
            raise ValueError("horizon_quantile must be in (0, 1]")
        if self.use_bands < 1 or self.band_step < 1:
            raise ValueError("use_bands and band_step must be >= 1")
        if not 0 <= self.min_horizon_ms <= self.max_horizon_ms:
            raise ValueError("need 0 <= min_horizon_ms <= max_horizon_ms")
        if self.host_mode not in ("recency", "host", "default", "gpu"):
            raise ValueError("host_mode must be 'recency', 'host', 'default' or 'gpu'")


@dataclass(slots=True)
class _Entry:
    uses: int
    last_seen: float  # seconds
    shape: int = -1  # for a chain's first block: the shape bucket of the request that created it


SHAPES = 8  # request shape = log2(prompt blocks), capped


def shape_of(num_blocks: int) -> int:
    return min(max(num_blocks, 1).bit_length() - 1, SHAPES - 1)


@dataclass(slots=True)
class TenantReuse:
    """One tenant's bounded statistics."""

    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    reached: list[int] = field(default_factory=lambda: [0] * BUCKETS)  # blocks that reached c uses
    reused: list[int] = field(default_factory=lambda: [0] * BUCKETS)  # ... and were used again in time
    gaps: list[float] = field(default_factory=list)  # reservoir of reuse gaps (seconds)
    gap_count: int = 0
    # New conversations by shape: how many started, how many came back within the horizon.
    opened: list[int] = field(default_factory=lambda: [0] * SHAPES)
    revisited: list[int] = field(default_factory=lambda: [0] * SHAPES)
    # New blocks appended to a known prefix ("tails"): how many, how many were used again.
    tails: int = 0
    tails_reused: int = 0
    # ReuseStats.horizon_ms of ``gaps`` as they are, None once they changed. Why: the horizon
    # is a quantile of the reservoir (a sort of up to ``reservoir`` values), asked for by
    # every plan and every observe, while a full reservoir takes a new gap ever more rarely.
    cached_horizon_ms: int | None = None

    def probability(self, uses_before: int) -> float:
        """P(used again | this use is use number ``uses_before + 1``), Beta(1,1)-smoothed."""
        bucket = min(uses_before, BUCKETS - 1)
        return (self.reused[bucket] + 1) / (self.reached[bucket] + 2)

    def revisit_probability(self, shape: int) -> float:
        """P(a new conversation of this shape comes back), Beta(1,1)-smoothed."""
        return (self.revisited[shape] + 1) / (self.opened[shape] + 2)

    def tail_probability(self) -> float:
        return (self.tails_reused + 1) / (self.tails + 2)


class ReuseStats:
    """Per-tenant reuse statistics; the only state adaptive retention keeps."""

    def __init__(self, config: AdaptiveConfig = AdaptiveConfig()) -> None:
        self.config = config
        self._tenants: dict[str, TenantReuse] = {}

    def tenant(self, tenant: str | None) -> TenantReuse:
        key = tenant or ""
        stats = self._tenants.get(key)
        if stats is None:
            stats = self._tenants[key] = TenantReuse()
        return stats

    def uses(self, tenant: str | None, hashes: Sequence[int]) -> list[int]:
        """Prior use count of each hash (0 = never seen or forgotten). Pure query."""
        entries = self.tenant(tenant).entries
        return [entries[h].uses if h in entries else 0 for h in hashes]

    def horizon_ms(self, tenant: str | None) -> int:
        """The ``horizon_quantile`` of the tenant's reuse gaps (ms, within the configured
        bounds); computed once per state of its gap reservoir (``TenantReuse.cached_horizon_ms``)."""
        stats = self.tenant(tenant)
        cached = stats.cached_horizon_ms
        if cached is not None:
            return cached
        cfg = self.config
        gaps = stats.gaps
        if not gaps:
            horizon = cfg.max_horizon_ms
        else:
            ordered = sorted(gaps)
            value = ordered[min(len(ordered) - 1, int(cfg.horizon_quantile * len(ordered)))] * 1000.0
            horizon = int(min(cfg.max_horizon_ms, max(cfg.min_horizon_ms, value)))
        stats.cached_horizon_ms = horizon
        return horizon

    def observe(self, tenant: str | None, hashes: Sequence[int], now: float, *, num_blocks: int | None = None) -> None:
        """Record one request's blocks (call once per request, after planning it).

        ``num_blocks`` (prompt blocks incl. a partial tail) gives the request's shape;
        it defaults to ``len(hashes)``.
        """
        if not hashes:
            return
        stats = self.tenant(tenant)
        entries = stats.entries
        horizon_s = self.horizon_ms(tenant) / 1000.0
        cfg = self.config
        root = entries.get(hashes[0])
        new_conversation = root is None
        if root is not None and root.uses == 1 and root.shape >= 0 and now - root.last_seen <= horizon_s:
            stats.revisited[root.shape] += 1
        # Deepest first, so a chain's root is the most recently touched entry and is
        # forgotten last (uses stay non-increasing along every remembered chain).
        for depth in range(len(hashes) - 1, -1, -1):
            h = hashes[depth]
            entry = entries.get(h)
            if entry is None:
                entries[h] = _Entry(1, now, -1 if not new_conversation else -2)
                stats.reached[0] += 1
                if not new_conversation:
                    stats.tails += 1
                if len(entries) > cfg.max_entries:
                    entries.popitem(last=False)
                continue
            entries.move_to_end(h)
            gap = now - entry.last_seen
            bucket = min(entry.uses - 1, BUCKETS - 1)
            if gap <= horizon_s:
                stats.reused[bucket] += 1
                if entry.shape == -1 and entry.uses == 1:
                    stats.tails_reused += 1
            self._record_gap(stats, gap, h)
            entry.uses += 1
            entry.last_seen = now
            stats.reached[min(entry.uses - 1, BUCKETS - 1)] += 1
        if new_conversation:
            shape = shape_of(num_blocks if num_blocks is not None else len(hashes))
            stats.opened[shape] += 1
            first = entries.get(hashes[0])
            if first is not None:
                first.shape = shape

    def _record_gap(self, stats: TenantReuse, gap: float, salt: int) -> None:
        stats.gap_count += 1
        if reservoir_add(stats.gaps, gap, count=stats.gap_count, salt=salt, size=self.config.reservoir):
            stats.cached_horizon_ms = None

    def num_entries(self) -> int:
        return sum(len(t.entries) for t in self._tenants.values())


def priority_for(probability: float, prior_uses: int, threshold: int, config: AdaptiveConfig, *,
                 host_tier: bool = False, first_use_floor: int = 0) -> int:
    """Map a reuse probability and prior use count to a priority band (see the module docstring).

    Kept bands start above 35 so that a block past its duration (back at 35, with
    ``use_durations``) sinks below every live one, and above ``T`` so that evicted kept
    blocks go to the host tier. With a host tier (``host_tier``) nothing is dropped in
    ``host_mode`` "host" or "default": a block that comes back after the GPU turned over
    can still be a host hit, so measured one-shot blocks go to T (offloaded, first out of
    the host) instead of 0; "default" also puts first uses at max(T, 35). ``first_use_floor``
    raises a first use that is kept (not dropped) to at least that priority (the selector's
    settling after a switch to the bands, ``retention/policy/selection.py``).
    """
    mode = config.host_mode if host_tier else "gpu"
    if mode == "recency":
        low = min(threshold, MAX_PRIORITY)
        return low if probability < config.host_sink_probability else max(low, 35)
    if probability < config.drop_probability:
        return 0 if mode == "gpu" else min(threshold, MAX_PRIORITY)
    if prior_uses == 0:
        if mode == "default":
            return min(max(threshold, 35, first_use_floor), MAX_PRIORITY)
        return min(max(threshold, first_use_floor), MAX_PRIORITY)  # T: first out of either tier
    base = max(threshold + 1, 36)
    return min(MAX_PRIORITY, base + config.band_step * (min(prior_uses, config.use_bands) - 1))


def adaptive_plan(
    stats: ReuseStats,
    tenant: str | None,
    hashes: Sequence[int],
    *,
    num_tokens: int,
    tokens_per_block: int,
    offload_min_priority: int,
    decode_priority: int = 0,
    host_tier: bool = False,
    first_use_floor: int = 0,
) -> RetentionPlan:
    """Per-block ranges from the tenant's statistics; equal neighbours merge, last open-ended.

    Blocks past the hashed ones (the partial tail) are treated as never seen. Invariant:
    priorities never increase with depth (running minimum), so a parent is never evicted
    before its child — TensorRT-LLM would otherwise drop the child with the parent.
    """
    cfg = stats.config
    tenant_stats = stats.tenant(tenant)
    horizon = stats.horizon_ms(tenant)
    uses = stats.uses(tenant, hashes)
    num_blocks = -(-num_tokens // tokens_per_block)
    new_conversation = not uses or uses[0] == 0
    fresh = tenant_stats.revisit_probability(shape_of(num_blocks)) if new_conversation else tenant_stats.tail_probability()
    spans = []
    ceiling = MAX_PRIORITY
    for index in range(num_blocks):
        prior = uses[index] if index < len(uses) else 0
        p = tenant_stats.probability(prior) if prior else fresh
        priority = min(ceiling, priority_for(p, prior, offload_min_priority, cfg, host_tier=host_tier,
                                             first_use_floor=first_use_floor))
        ceiling = priority
        duration = horizon if priority > 35 and cfg.use_durations else None
        start = index * tokens_per_block
        spans.append((start, start + tokens_per_block, priority, duration))
    return RetentionPlan(merged_ranges(spans), decode_priority, None)


@dataclass(slots=True)
class AdaptivePolicy:
    """The simulator's ``adaptive`` policy: same statistics and planner as the gateway."""

    stats: ReuseStats
    block_size: int = 512
    offload_min_priority: int = 30
    name: str = "adaptive"
    uses_host: bool = True

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        return adaptive_plan(
            self.stats, request.tenant, hashes, num_tokens=request.input_length,
            tokens_per_block=pool.config.tokens_per_block, offload_min_priority=self.offload_min_priority,
            host_tier=pool.config.secondary_blocks > 0,
        )

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001
        self.stats.observe(request.tenant, hashes, now, num_blocks=-(-request.input_length // pool.config.tokens_per_block))


def adaptive_policy(*, mapping=None, block_size: int = 512, config: AdaptiveConfig = AdaptiveConfig()) -> AdaptivePolicy:  # noqa: ANN001
    """Factory used by ``kvgate simulate -p adaptive`` (the class mapping's threshold if given)."""
    threshold = mapping.offload_min_priority if mapping is not None else 30
    return AdaptivePolicy(ReuseStats(config), block_size, threshold)
