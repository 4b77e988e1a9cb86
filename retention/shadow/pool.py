"""A sampled shadow pool: the real :class:`~retention.pool.BlockPool` on a slice of the chains.

Fed one request at a time (its full-block chain hashes, the plan it would get, ``now``), a
:class:`ShadowPool` keeps the blocks :class:`~retention.shadow.sampling.HashSample` selects
and replays them, in chain order, through a real ``BlockPool`` of ``C × R`` GPU blocks
(+ ``H × R`` host blocks), with the plan's priority and duration for each kept block::

    request blocks   b0  b1  b2  b3  b4  b5  b6 (partial)
    kept (R slice)        ✓           ✓
    shadow request   [b1'][b4'][t]      b' = 2 tokens from b's 64-bit hash, t = 1 tail token

Why this is faithful: a kept block's shadow parent is the previous *kept* block of the same
chain, which is a function of the chain's prefix, so equal prefixes give equal shadow
chains and different prefixes never share a shadow block; the pool's leaf-first eviction
keeps its contents prefix-closed, so a shadow hit on b4' stands for the real hits on the
blocks up to b4. The partial tail token makes every kept block matchable (the pool never
matches a prompt's last token) and takes one transient slot, which is why the pool gets one
extra GPU block: between requests the cached capacity is exactly ``C × R``. The plan's
decode retention is irrelevant (no decode blocks are allocated).

Estimates (SHARDS' ratio estimator): hit ratio of full blocks = kept hits / kept references,
times the exact share of prompt tokens that sit in full blocks (every request is counted,
sampled or not), which gives the prompt-token hit rate the simulator reports.

Every estimate states its own error. The kept blocks are split into ``JACKKNIFE_GROUPS``
groups by their hash's low bits (independent of the slice, which uses the high bits), and
the delete-one-group jackknife of the ratio gives a standard error: the spread of the
estimate over which blocks happened to fall in the slice, the error that dominates (the
estimator is nearly unbiased). It grows as the sample's distinct blocks shrink, so a 1 %
slice of a small trace says "± 4 points" instead of looking precise (docs/benchmarks.md,
``bench:shadow_accuracy``, checks the interval against full replays). Cache interaction
between groups is ignored (a deleted group's blocks still competed for the shadow).

Deliberate approximations: requests are admitted and released at once (``--hold none``:
the shadow models cache contents, not blocks held by running requests); a prompt whose
length is a multiple of the block size has its last full block matchable in the shadow
(the real pool cannot match it); kept blocks of a request the shadow cannot fit count as
misses.

Bounds: memory O(C × R + H × R) blocks plus one counter set (2 × JACKKNIFE_GROUPS + 6
integers) per tenant seen; CPU per request O(blocks) integer comparisons + O(kept blocks)
pool work (one SHA-256 each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from retention.pool import BlockPool, PoolConfig
from retention.pool.types import per_block_retention
from retention.shadow.sampling import HashSample
from retention.types import DEFAULT_PLAN, RetentionPlan, merged_ranges

SHADOW_TOKENS_PER_BLOCK = 2
JACKKNIFE_GROUPS = 16  # a power of two: a kept block's group is ``hash & (JACKKNIFE_GROUPS - 1)``
_MASK31 = (1 << 31) - 1
_GROUP_MASK = JACKKNIFE_GROUPS - 1


def _zeros() -> list[int]:
    return [0] * JACKKNIFE_GROUPS


@dataclass(slots=True)
class ShadowCounts:
    """Cumulative counts (kept references and hits are in sampled blocks, tokens are exact)."""

    requests: int = 0
    prompt_tokens: int = 0  # every request, sampled or not
    full_block_tokens: int = 0  # tokens in every request's full blocks
    kept_blocks: int = 0  # kept (sampled) full-block references
    hit_blocks: int = 0  # of those, matched in the shadow pool (GPU or host)
    host_hit_blocks: int = 0  # of those, onboarded from the shadow host tier
    kept_by_group: list[int] = field(default_factory=_zeros)  # kept_blocks split by jackknife group
    hits_by_group: list[int] = field(default_factory=_zeros)  # hit_blocks split likewise

    def hit_rate(self) -> float | None:
        """Estimated prompt-token hit rate; ``None`` before any kept reference."""
        if not self.kept_blocks or not self.prompt_tokens:
            return None
        return self.hit_blocks / self.kept_blocks * self.full_block_tokens / self.prompt_tokens

    def hit_rate_stderr(self) -> float | None:
        """Delete-one-group jackknife standard error of :meth:`hit_rate` (same units).

        ``None`` until at least two groups hold kept references (no spread to measure).
        Invariant: ``sum(kept_by_group) == kept_blocks`` and ``sum(hits_by_group) == hit_blocks``.
        """
        groups = [(k, h) for k, h in zip(self.kept_by_group, self.hits_by_group, strict=True) if k]
        if len(groups) < 2 or not self.prompt_tokens:
            return None
        scale = self.full_block_tokens / self.prompt_tokens
        kept, hits = self.kept_blocks, self.hit_blocks
        # Deleting a group with every kept reference is impossible here (two groups are non-empty).
        leave_out = [(hits - h) / (kept - k) * scale for k, h in groups]
        mean = sum(leave_out) / len(leave_out)
        n = len(leave_out)
        return ((n - 1) / n * sum((x - mean) ** 2 for x in leave_out)) ** 0.5

    def host_hit_rate(self) -> float | None:
        if not self.kept_blocks or not self.prompt_tokens:
            return None
        return self.host_hit_blocks / self.kept_blocks * self.full_block_tokens / self.prompt_tokens


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """One request in one shadow pool: kept references and hits (sampled blocks)."""

    kept: int
    hits: int
    host_hits: int


@dataclass(slots=True)
class ShadowPool:
    """One sampled shadow of a pool of ``primary_blocks`` GPU (+ ``secondary_blocks`` host) blocks.

    Invariants: the inner pool has ``sample.scale(primary_blocks) + 1`` GPU and
    ``sample.scale(secondary_blocks)`` host blocks; holds no request between calls.
    """

    sample: HashSample
    primary_blocks: int
    secondary_blocks: int = 0
    offload_min_priority: int = 30
    counts: ShadowCounts = field(default_factory=ShadowCounts)
    tenants: dict[str, ShadowCounts] = field(default_factory=dict)
    _pool: BlockPool = field(init=False, repr=False)
    _next_id: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.primary_blocks < 1 or self.secondary_blocks < 0:
            raise ValueError("primary_blocks must be >= 1 and secondary_blocks >= 0")
        self._pool = BlockPool(PoolConfig(
            primary_blocks=self.sample.scale(self.primary_blocks) + 1,
            secondary_blocks=self.sample.scale(self.secondary_blocks),
            tokens_per_block=SHADOW_TOKENS_PER_BLOCK,
            secondary_offload_min_priority=self.offload_min_priority,
            event_buffer_max_size=0,
        ))

    @property
    def pool(self) -> BlockPool:
        """The inner pool (read-only use: stats, tests)."""
        return self._pool

    def observe(
        self,
        hashes: Sequence[int],
        plan: RetentionPlan = DEFAULT_PLAN,
        *,
        now: float,
        num_tokens: int,
        tokens_per_block: int,
        tenant: str | None = None,
        kept: Sequence[int] | None = None,
    ) -> ShadowOutcome:
        """Replay one request; ``hashes`` are its full blocks' chain hashes (pool block size).

        ``kept`` may pass ``sample.indices(hashes)`` when the caller already has it (several
        shadows on one sample share the filtering).
        """
        index = self.sample.indices(hashes) if kept is None else kept
        outcome = self._replay(hashes, index, plan, now, num_tokens, tokens_per_block)
        full_tokens = len(hashes) * tokens_per_block
        targets = [self.counts]
        if tenant is not None:
            targets.append(self.tenants.setdefault(tenant, ShadowCounts()))
        # A shadow hit is a matched prefix of the shadow request, so the hits are the first
        # ``outcome.hits`` kept blocks.
        groups = [hashes[i] & _GROUP_MASK for i in index]
        for c in targets:
            c.requests += 1
            c.prompt_tokens += num_tokens
            c.full_block_tokens += min(full_tokens, num_tokens)
            c.kept_blocks += outcome.kept
            c.hit_blocks += outcome.hits
            c.host_hit_blocks += outcome.host_hits
            kept_by, hits_by = c.kept_by_group, c.hits_by_group
            for j, g in enumerate(groups):
                kept_by[g] += 1
                if j < outcome.hits:
                    hits_by[g] += 1
        return outcome

    def _replay(self, hashes: Sequence[int], index: Sequence[int], plan: RetentionPlan, now: float,
                num_tokens: int, tokens_per_block: int) -> ShadowOutcome:
        if not index:
            return ShadowOutcome(0, 0, 0)
        tokens = np.empty(len(index) * SHADOW_TOKENS_PER_BLOCK + 1, dtype=np.int32)
        for j, i in enumerate(index):
            h = hashes[i]
            tokens[2 * j] = h & _MASK31
            tokens[2 * j + 1] = (h >> 31) & _MASK31
        tokens[-1] = 0
        shadow_plan = _shadow_plan(plan, index, num_tokens, tokens_per_block)
        self._next_id += 1
        alloc = self._pool.allocate(self._next_id, tokens, salt=None, tenant=None, plan=shadow_plan, now=now)
        if alloc is None:  # more kept blocks than the shadow holds: all misses, nothing changes
            return ShadowOutcome(len(index), 0, 0)
        self._pool.release(self._next_id, tokens, now=now, num_computed_tokens=len(tokens))
        return ShadowOutcome(len(index), alloc.reused_blocks, alloc.onboarded_blocks)


def _shadow_plan(plan: RetentionPlan, index: Sequence[int], num_tokens: int, tokens_per_block: int) -> RetentionPlan:
    """The plan's (priority, duration) of each kept block, in shadow token coordinates."""
    if not plan.ranges:
        return plan
    per_block = per_block_retention(plan, -(-num_tokens // tokens_per_block), tokens_per_block)
    spans = []
    for j, i in enumerate(index):
        retention = per_block[i] if i < len(per_block) else None
        if retention is None:
            continue  # uncovered: the pool's default (35 new, unchanged on reuse), as in the real pool
        start = j * SHADOW_TOKENS_PER_BLOCK
        spans.append((start, start + SHADOW_TOKENS_PER_BLOCK, retention[0], retention[1]))
    if not spans:
        return RetentionPlan((), plan.decode_priority, plan.decode_duration_ms)
    # The last range comes out open-ended; it cannot swallow an uncovered kept block because
    # a plan's own last range is open-ended too (every block past a covered one is covered).
    return RetentionPlan(merged_ranges(spans), plan.decode_priority, plan.decode_duration_ms)
