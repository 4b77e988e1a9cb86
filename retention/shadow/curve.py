"""Online miss-ratio curves: one sampled shadow pool per candidate capacity, fed the live plans.

A :class:`MissRatioCurve` answers "what would more (or fewer) GPU / host blocks buy?" from
the requests a pool actually serves: every capacity in ``capacities`` gets a
:class:`~retention.shadow.pool.ShadowPool` on the same hash slice, and each request is
replayed in every one with the plan it really got. Priorities break the stack property, so
the capacities are simulated separately (no single-pass stack distances); the cost is one
shadow replay of the kept blocks per capacity.

Usage (gateway or simulator; ``now`` in seconds from any monotonic origin)::

    curve = MissRatioCurve([512, 1024, 2048, 4096], rate=0.01, host_blocks=lambda gpu: 4 * gpu)
    curve.observe(hashes, plan, now=now, num_tokens=len(prompt), tokens_per_block=32, tenant="acme")
    curve.points()  # [CurvePoint(gpu_blocks=512, host_blocks=2048, hit_rate=0.21, stderr=0.012), ...]

Each point carries the jackknife standard error of its estimate (``ShadowCounts.hit_rate_stderr``):
report ``hit_rate ± 2 × stderr``, and raise the rate when that interval is too wide to decide on.

Bounds: memory Σ (C + H) × rate blocks; CPU per request O(blocks) + Σ O(kept blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from retention.shadow.pool import ShadowPool
from retention.shadow.sampling import HashSample
from retention.types import DEFAULT_PLAN, TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY, RetentionPlan


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One capacity's estimate; ``hit_rate`` / ``stderr`` are ``None`` before any sampled block."""

    gpu_blocks: int
    host_blocks: int
    hit_rate: float | None
    stderr: float | None


@dataclass(slots=True)
class MissRatioCurve:
    capacities: Sequence[int]
    rate: float = 0.01
    host_blocks: Callable[[int], int] = lambda gpu: 0
    offload_min_priority: int = TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY
    pools: list[ShadowPool] = field(init=False)
    sample: HashSample = field(init=False)

    def __post_init__(self) -> None:
        if not self.capacities or any(c < 1 for c in self.capacities):
            raise ValueError("capacities must be a non-empty list of block counts >= 1")
        self.sample = HashSample(self.rate)
        self.pools = [
            ShadowPool(self.sample, c, self.host_blocks(c), self.offload_min_priority) for c in self.capacities
        ]

    def observe(self, hashes: Sequence[int], plan: RetentionPlan = DEFAULT_PLAN, *, now: float, num_tokens: int,
                tokens_per_block: int, tenant: str | None = None) -> None:
        kept = self.sample.indices(hashes)
        for pool in self.pools:
            pool.observe(hashes, plan, now=now, num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                         tenant=tenant, kept=kept)

    def points(self, tenant: str | None = None) -> list[CurvePoint]:
        """One :class:`CurvePoint` per capacity, in ``capacities`` order (pool-wide or one tenant's)."""
        out = []
        for pool in self.pools:
            counts = pool.counts if tenant is None else pool.tenants.get(tenant)
            rate = None if counts is None else counts.hit_rate()
            stderr = None if counts is None else counts.hit_rate_stderr()
            out.append(CurvePoint(pool.primary_blocks, pool.secondary_blocks, rate, stderr))
        return out
