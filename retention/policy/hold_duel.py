"""Whether the conversation hold pays, judged on two sampled shadows of the pool: held and not held.

A hold is a bet that the held prefix is worth more than what it pushes out. The contest that
decides it is the pool's own policy contest (:class:`retention.shadow.duel.PolicyDuel`, the same
rule and thresholds): two :class:`~retention.shadow.pool.ShadowPool` s of the pool's shape over one
slice of the block-hash space replay *every* request of the pool, one with the plan each request
gets without the hold (``never``), one with the plan it would get held (``always``); the pool
holds while ``always``'s shadow hits measurably more than ``never``'s::

    per kept reference (a sampled block of any request):
        hits[k] ← hits[k] · d + hit_k,  refs ← refs · d + 1          k ∈ {never, always}
    switch to the other arm when refs ≥ min_refs and hits[other] ≥ hits[current] · (1 + margin) + 1
        for ``patience`` kept references in a row

The pool starts on ``never`` (no evidence, no hold: the engine's own order). What a shadow
measures is the question the pool asks, "is the pool better off if every eligible request is
held", because each shadow holds one arm for everybody: held prefixes push out the unheld
blocks of the same shadow, never of the other. (The set dueling this replaced let an
"always" and a "never" set of conversations share the real pool; held leaders outranked every
unheld block there, so the contest measured the private gain of being held and leaned towards
holding: on ``agent-loop`` at 2 % GPU the pool ended a point below LRU, on ``chat`` at 5 %
one and a half; ``bench/retention/conversation.py`` states the figures.)

The ``always`` arm's plans come from a hypothetical budget of its own (:attr:`HoldDuel.budget`,
a :class:`~retention.policy.hint_quota.HintLedger` counting what the arm would hold, from the
moment it is planned), so the shadow holds what the budget would let the pool hold whichever
arm is in force. Two approximations, both towards holding a little more in the shadow than
the pool could: in the gateway the real budget is the pool's hint ledger, which the clients'
cache hints share and which counts a hold again from the request's release (when the engine
starts its duration), while the hypothetical one sees holds only, from plan time. Generated
blocks are not in the shadows (a shadow replays prompt hashes): the decode hold's cost and
gain are not measured, only its share of the budget. The shadows take the pool's shape from
the request; a resized pool starts a new contest (on ``never``).

Pure and deterministic: no clock, no randomness. Cost per request: one pass over its hashes;
two shadow replays of its sampled blocks when it has any. Memory: two shadows of the duel's
sampled size and the hypothetical budget's held keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from retention.policy.hint_quota import HintLedger
from retention.shadow.duel import DuelConfig, PolicyDuel
from retention.types import RetentionPlan

ARMS: tuple[str, str] = ("never", "always")  # index 0, the incumbent: no hold
# The pool's contest alone: a hold is one pool's decision (tenants share its budget).
HOLD_DUEL = DuelConfig(per_tenant=False)


@dataclass(frozen=True, slots=True)
class PoolShape:
    """The pool the shadows scale down: GPU and host blocks, the host tier's offload threshold."""

    primary_blocks: int
    secondary_blocks: int = 0
    offload_min_priority: int = 35


@dataclass(slots=True)
class HoldDuel:
    """The pool's arm (``never`` / ``always``), decided on two shadows; created on the first request."""

    config: DuelConfig = HOLD_DUEL
    budget: HintLedger = field(default_factory=HintLedger)  # what the ``always`` arm would hold
    duel: PolicyDuel | None = None
    shape: PoolShape | None = None  # the pool's shape the shadows were made for

    @property
    def arm(self) -> str:
        """The arm in force: ``never`` until ``always``'s shadow proves itself."""
        return ARMS[0 if self.duel is None else self.duel.pool_scope.current]

    def holds(self) -> bool:
        return self.arm == "always"

    @property
    def switches(self) -> int:
        return 0 if self.duel is None else self.duel.switches()

    def record(self, shape: PoolShape, hashes: Sequence[int], never: RetentionPlan, always: RetentionPlan, *,
               now: float, num_tokens: int, tokens_per_block: int) -> None:
        """Replay one request of the pool in both shadows (``never`` is ``always`` when nothing would be held)."""
        if self.duel is None or shape != self.shape:
            self.shape = shape
            self.duel = PolicyDuel(ARMS, shape.primary_blocks, shape.secondary_blocks, shape.offload_min_priority,
                                   self.config)
        kept = self.duel.kept(hashes)
        if kept:
            self.duel.record(hashes, kept, (never, always), now=now, num_tokens=num_tokens,
                             tokens_per_block=tokens_per_block)

    def standings(self) -> dict[str, float]:
        """Each arm's decayed shadow hit ratio (for metrics and the bench)."""
        return {name: 0.0 for name in ARMS} if self.duel is None else self.duel.standings()


__all__ = ["ARMS", "HOLD_DUEL", "HoldDuel", "PoolShape"]
