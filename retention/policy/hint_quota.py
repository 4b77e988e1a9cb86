"""How many blocks a tenant holds under hints: the bound behind ``hint_quota_fraction``.

The engines report blocks per tenant and tier (the KV quota's input), not which of them a
hint raised. So the ledger counts from the plans themselves, conservatively: every full
prompt block a hint covered is *live* from the request that hinted it until its hinted
duration has run out after its last hinted use, whether or not the engine still holds it
(an evicted block is still counted). The count is therefore an upper bound on the hinted
blocks the engine holds, and keeping it under the budget keeps the real figure under too.

    blocks of a hinted prompt   h0 h1 h2 h3 h4 h5       (full-block chain hashes, salted)
    already live for the tenant h0 h1                    (counted once)
    budget 4, live 2            h0 h1 h2 h3 | h4 h5      → the hint stops at h4: 4 blocks allowed

Keys are (tenant, salted block hash): one tenant's entries never count against, or match,
another's, whatever its isolation. Pure: the caller passes ``now`` (seconds, any monotonic
clock) and calls :meth:`HintLedger.record` when it plans and again when the request ends
(TensorRT-LLM starts a duration when the block is released). Memory: at most the budget's
worth of entries per tenant, since :meth:`allowance` never lets more in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from retention.policy.hint_plan import HintPolicy, apply_hints, clip_spans, hint_spans
from retention.policy.hints import CacheHints
from retention.types import RetentionPlan


@dataclass(slots=True)
class HintLedger:
    """Per tenant: salted block hash -> when its hinted duration runs out (seconds)."""

    _live: dict[str, dict[int, float]] = field(default_factory=dict)

    def live_blocks(self, tenant: str, now: float) -> int:
        """Hinted blocks of ``tenant`` whose duration has not run out; forgets the others."""
        entries = self._live.get(tenant)
        if not entries:
            return 0
        expired = [h for h, until in entries.items() if until <= now]
        for h in expired:
            del entries[h]
        return len(entries)

    def allowance(self, tenant: str, hashes: Sequence[int], budget_blocks: int, now: float) -> int:
        """How many leading blocks of ``hashes`` may be hinted without the tenant's live
        hinted blocks exceeding ``budget_blocks`` (blocks already live cost nothing)."""
        live = self.live_blocks(tenant, now)
        entries = self._live.get(tenant, {})
        allowed = 0
        for h in hashes:
            if h not in entries:
                if live >= budget_blocks:
                    break
                live += 1
            allowed += 1
        return allowed

    def record(self, tenant: str, hashes: Sequence[int], durations_ms: Sequence[int], now: float) -> None:
        """Mark ``hashes`` hinted until ``now + duration`` (each keeps its latest end)."""
        entries = self._live.setdefault(tenant, {})
        for h, duration in zip(hashes, durations_ms):
            until = now + duration / 1000.0
            if entries.get(h, -1.0) < until:
                entries[h] = until


@dataclass(frozen=True, slots=True)
class HintedPlan:
    """A plan after hints, and the blocks they cover (to :meth:`HintLedger.record` again at release)."""

    plan: RetentionPlan
    hashes: tuple[int, ...] = ()
    durations_ms: tuple[int, ...] = ()
    clipped: bool = False  # the quota share cut the hinted tokens short


def plan_with_hints(plan: RetentionPlan, hints: CacheHints, policy: HintPolicy, *, total: int, tokens_per_block: int,
                    hashes: Sequence[int], ledger: HintLedger, tenant: str, budget_blocks: int,
                    now: float) -> HintedPlan:
    """``plan`` with ``hints`` applied within the class (``policy``) and the tenant's hint budget.

    ``hashes``: the prompt's full-block chain hashes as the engine computes them (salted).
    The hinted tokens are cut at the first block the budget has no room for; the blocks kept
    are recorded in ``ledger``. Returns ``HintedPlan(plan)`` (the same plan object) when no
    hint applies: hints off, no span, a demoted plan, or no room at all.
    """
    # Only full blocks are counted in the ledger, so only full blocks are hinted: the
    # prompt's partial tail block keeps the class's retention.
    spans = clip_spans(hint_spans(hints, policy, total), len(hashes) * tokens_per_block)
    if not spans or plan.demoted:
        return HintedPlan(plan)
    blocks = [b for b in range(-(-max(s.end for s in spans) // tokens_per_block))
              if any(s.start <= b * tokens_per_block < s.end for s in spans)]
    # Hinted blocks form a prefix of the prompt (spans start at 0 and touch), so the
    # allowance over them in order is a token cut.
    hinted_hashes = [hashes[b] for b in blocks]
    allowed = ledger.allowance(tenant, hinted_hashes, budget_blocks, now)
    clipped = allowed < len(blocks)
    if clipped:
        cut = blocks[allowed] * tokens_per_block
        spans = clip_spans(spans, cut)
    if not spans:
        return HintedPlan(plan, clipped=clipped)
    kept = blocks[:allowed]
    durations = tuple(next(s.duration_ms for s in spans if s.start <= b * tokens_per_block < s.end) for b in kept)
    kept_hashes = tuple(hashes[b] for b in kept)
    ledger.record(tenant, kept_hashes, durations, now)
    return HintedPlan(apply_hints(plan, spans, policy, total), kept_hashes, durations, clipped)
