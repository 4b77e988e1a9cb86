"""``adaptive`` with selection: the tenant's static class, adaptive's bands or ``protect``, whichever wins.

One :class:`AdaptiveSelector` per pool holds the adaptive reuse statistics
(``retention/policy/adaptive.py``) and a :class:`~retention.shadow.duel.PolicyDuel` between the
candidates on sampled shadows of the pool's own shape. Per request it computes the plan of
the candidate the request's tenant follows (every candidate's plan when the request has
sampled blocks, to feed the shadows), then records the request in the statistics. The
gateway owns one per pool and calls :meth:`AdaptiveSelector.plan`; the simulator's
``adaptive`` policy (:class:`AdaptiveSelectPolicy`) calls the very same method, so a
simulated run is what the gateway would have done.

Candidates (``names``):

* ``static`` — the tenant's retention class as the planner plans it; with no class (the
  simulator without ``--classes``) TensorRT-LLM's defaults: everything at 35, every evicted
  block offloaded. This is the incumbent: a pool follows anything else only on evidence.
  A static plan that leaves prompt tokens uncovered is sent covering the whole prompt at
  35 (no expiry): a reused block takes a priority only from a range that covers it
  (``KvCacheRetentionConfig::getPerBlockRetentionPriorityDuration`` in ``executor.h``;
  ``LRUEvictionPolicy::claimBlock`` in ``evictionPolicy.cpp`` keeps the block's priority
  when none is given), so an uncovered static plan would leave every block ``bands`` or
  ``protect`` raised at its raised priority for good once the pool follows ``static``.
* ``bands`` — adaptive's bands, host-tier aware when the pool has a host tier
  (``adaptive_plan(..., host_tier=True)``);
* ``protect`` — GPU-only pools: a live subset of conversations that fits the GPU above the
  rest, for as long as the median revisit gap (``retention/policy/protect.py``). Not offered with a
  host tier: offload keeps a block's priority and clears its duration (``getFreeBlock`` in
  ``evictionPolicy.cpp``, see ``retention/pool.py``), so the protected band would pin
  finished conversations in host memory for good.

``names=None`` (the default, what the gateway uses) picks :func:`default_candidates` for the
pool's shape.

Settling. A GPU-only pool that switches to the bands holds what the previous candidate planned at
35 (``static``'s whole prompts, ``protect``'s unprotected history and expired holds); on the bands'
scale those blocks rank above every first use (T, 30 by default) and below nothing a flood sends
(0), so they would keep their slots for good. After such a switch the bands plan kept first uses at
35 (in LRU order with those blocks, so the oldest go first) until as many kept first-use blocks as
the pool holds were planned, i.e. until the pool has turned over; then at T again. Only the pool's
own switch settles (every request then moves to the bands, and every request on the bands settles,
a tenant already there by its own choice too); a tenant that follows its own winner while the mix
leads does not (``retention/shadow/duel.py``): the mix's shadow judged exactly that mix, first uses at T. Measured
(``bench/retention/generalize.py``'s families, seed 0, GPU only): noisy-neighbour 1 % and 2 %
2.81 → 3.11 % and 2.88 → 3.14 % (the bands alone 3.25 %), synthetic within 0.12 points either way,
api 0.04–0.22 points lower at 2–10 % (a report family), the rest within 0.04.

The simulator also knows ``adaptive-bands`` and ``protect`` (each candidate alone, no selection) for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from retention.policy.adaptive import AdaptiveConfig, ReuseStats, adaptive_plan
from retention.policy.protect import ConversationTracker, ProtectConfig, protect_plan
from retention.shadow.duel import DuelConfig, PolicyDuel
from retention.types import DEFAULT_PLAN, DEFAULT_PRIORITY, RetentionPlan, filled

CANDIDATES = ("static", "bands", "protect")


def default_candidates(secondary_blocks: int) -> tuple[str, ...]:
    """The candidates a pool duels: all of them GPU-only, ``static`` and ``bands`` with a host tier."""
    return ("static", "bands") if secondary_blocks > 0 else CANDIDATES


def covering(plan: RetentionPlan, num_tokens: int) -> RetentionPlan:
    """``plan`` with every prompt token it leaves uncovered at 35, no expiry (the same plan when none is):
    what TensorRT-LLM gives a *new* block without a range, made explicit so that a *reused* block is
    reset to it too rather than keeping what another candidate gave it (:func:`~retention.types.filled`)."""
    ranges = filled(plan.ranges, DEFAULT_PRIORITY, end=num_tokens)
    return plan if len(ranges) == len(plan.ranges) else replace(plan, ranges=ranges)


def _kept_first_uses(plan: RetentionPlan, uses: Sequence[int], num_blocks: int, tokens_per_block: int) -> int:
    """Blocks of the request seen for the first time that ``plan`` keeps at 35 or above: the new blocks
    that compete with what the pool holds at 35 (a dropped block, at 0, displaces none of it)."""
    count = 0
    for r in plan.ranges:
        if r.priority < DEFAULT_PRIORITY:
            continue
        end = num_blocks if r.end is None else min(num_blocks, -(-r.end // tokens_per_block))
        count += sum(1 for i in range(r.start // tokens_per_block, end) if i >= len(uses) or uses[i] == 0)
    return count


@dataclass(slots=True)
class AdaptiveSelector:
    """Per pool: reuse statistics + a duel between the candidates. Pure; the caller passes ``now``."""

    primary_blocks: int
    secondary_blocks: int = 0
    offload_min_priority: int = 30
    adaptive: AdaptiveConfig = AdaptiveConfig()
    duel_config: DuelConfig = DuelConfig()
    names: tuple[str, ...] | None = None  # None: default_candidates(secondary_blocks)
    protect: ProtectConfig = ProtectConfig()
    settle: bool = True  # after the pool switches to the bands, first uses at 35 until the pool turned over
    stats: ReuseStats = field(init=False)
    tracker: ConversationTracker | None = field(init=False)
    duel: PolicyDuel = field(init=False)
    # Kept first-use blocks still to plan at 35 after the pool switched to the bands (see :meth:`plan`).
    settling: int = field(init=False, default=0)
    _pool_choice: int = field(init=False, default=0)  # the pool's candidate when the last request was planned

    def __post_init__(self) -> None:
        if self.names is None:
            self.names = default_candidates(self.secondary_blocks)
        unknown = set(self.names) - set(CANDIDATES)
        if unknown:
            raise ValueError(f"unknown candidates {sorted(unknown)}; known: {', '.join(CANDIDATES)}")
        self.stats = ReuseStats(self.adaptive)
        # Conversations are tracked only when a candidate needs them (bounded, but not free).
        self.tracker = ConversationTracker(self.primary_blocks, self.protect) if "protect" in self.names else None
        self.duel = PolicyDuel(self.names, self.primary_blocks, self.secondary_blocks, self.offload_min_priority,
                               self.duel_config)

    def plan(self, *, tenant: str | None, hashes: Sequence[int], num_tokens: int, tokens_per_block: int,
             static: RetentionPlan = DEFAULT_PLAN, now: float, decode_priority: int | None = None) -> RetentionPlan:
        """The request's plan; records the request (shadows when sampled, statistics always).

        ``hashes``: the prompt's full-block chain hashes at the pool's ``tokens_per_block``
        with the salt the engine sees; ``static``: the plan of the tenant's class (over-quota
        demotion is the caller's business, before or instead of this call). ``decode_priority``
        for the bands defaults to the static plan's.
        """
        decode = static.decode_priority if decode_priority is None else decode_priority
        duel = self.duel
        kept = duel.kept(hashes)
        index = duel.choice(tenant)
        num_blocks = -(-num_tokens // tokens_per_block)

        def candidate(name: str, first_use_floor: int = 0) -> RetentionPlan:
            if name == "static":
                return covering(static, num_tokens)
            if name == "protect":
                return protect_plan(self.tracker, hashes, num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                                    now=now, offload_min_priority=self.offload_min_priority, decode_priority=decode)
            return adaptive_plan(
                self.stats, tenant, hashes, num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                offload_min_priority=self.offload_min_priority, decode_priority=decode,
                host_tier=self.secondary_blocks > 0, first_use_floor=first_use_floor,
            )

        pool_choice = duel.pool_scope.current
        if pool_choice != self._pool_choice:
            # The pool switched (on the last sampled request's evidence): onto the bands, GPU only, it settles.
            onto_bands = self.settle and self.names[pool_choice] == "bands" and self.secondary_blocks == 0
            self.settling = self.primary_blocks if onto_bands else 0
            self._pool_choice = pool_choice
        name = self.names[index]
        settling = name == "bands" and self.settling > 0
        if kept:
            plans = [candidate(n) for n in self.names]
            chosen = candidate(name, DEFAULT_PRIORITY) if settling else plans[index]
            duel.record(hashes, kept, plans, now=now, num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                        tenant=tenant)
        else:
            chosen = candidate(name, DEFAULT_PRIORITY if settling else 0)
        if settling:
            self.settling -= _kept_first_uses(chosen, self.stats.uses(tenant, hashes), num_blocks, tokens_per_block)
        self.stats.observe(tenant, hashes, now, num_blocks=num_blocks)
        if self.tracker is not None:
            self.tracker.observe(hashes, now, num_blocks=num_blocks)
        return chosen


@dataclass(slots=True)
class AdaptiveSelectPolicy:
    """The simulator's ``adaptive``: an :class:`AdaptiveSelector` sized from the replayed pool.

    ``static`` is the policy whose plan the ``static`` candidate uses (``trtllm-default`` or
    the ``class`` policy with ``--classes``). Plans are made once per request: with
    ``--hold tokens`` a waiting request is planned again on every admission attempt, and
    the shadows must see it once.
    """

    static: object  # a SimPolicy (retention.simulation.sim_policies); typed loosely to avoid an import cycle
    adaptive: AdaptiveConfig = AdaptiveConfig()
    duel_config: DuelConfig = DuelConfig()
    names: tuple[str, ...] | None = None  # None: default_candidates of the replayed pool
    name: str = "adaptive"
    uses_host: bool = True
    selector: AdaptiveSelector | None = None
    _last: tuple[int, RetentionPlan] | None = None

    @property
    def offload_min_priority(self) -> int:
        return self.static.offload_min_priority  # type: ignore[attr-defined]

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        if self._last is not None and self._last[0] == request.index:
            return self._last[1]
        if self.selector is None:
            cfg = pool.config
            self.selector = AdaptiveSelector(cfg.primary_blocks, cfg.secondary_blocks, cfg.secondary_offload_min_priority,
                                             self.adaptive, self.duel_config, self.names)
        static = self.static.plan(request, hashes, now=now, pool=pool)  # type: ignore[attr-defined]
        chosen = self.selector.plan(
            tenant=request.tenant, hashes=hashes, num_tokens=request.input_length,
            tokens_per_block=pool.config.tokens_per_block, static=static, now=now, decode_priority=0,
        )
        self._last = (request.index, chosen)
        return chosen

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - SimPolicy protocol
        return None  # the selector records each request when it plans it
