"""Retention that knows the conversation and the tool loop: hold a live prefix for its measured gap.

Two kinds of requests are likely to come back with their whole prefix (prompt + generated
tokens) within a short, measurable time:

* a request that **offers tools** (any API; but the tool gaps that size its hold are measured
  only on stored Responses chains, so a tenant whose tool loops never send
  ``previous_response_id`` has none, and its tool-offering requests are not held): it is likely
  to end in a tool call whose result comes back within the tool's latency (Continuum, arXiv 2511.02230, pins the KV during
  tool calls with a TTL; here the TTL is set at enqueue);
* a request whose response is **stored** (OpenAI Responses ``store``): its conversation may
  be continued by ``previous_response_id`` after the user's think time.

Per tenant the :class:`ConversationLedger` measures, from the request stream itself, the gap
between a stored response and the request continuing it: a *tool* gap when that response
offered tools, a *turn* gap otherwise. The stream does not depend on the cache, so the gaps
are not censored by the holds. A request of either kind is then held at the class's
conversation priority (its ``hint_max_priority``) for::

    hold = min(hint_max_ttl_ms, the response store's TTL,
               max(MIN_HOLD_MS, GAP_MARGIN × the kind's GAP_QUANTILE gap))       (≥ MIN_GAP_SAMPLES gaps)
    no hold                                                                      (before that)

Unlike a client's hint (which holds its TTL until gaps are measured), the hold here is
nobody's request: without evidence there is none. (Holding the class's whole TTL before
the first gaps pinned the first runs' dead blocks for an hour in the simulator.)

as TensorRT-LLM accepts at enqueue (``KvCacheRetentionConfig`` in
``cpp/include/tensorrt_llm/executor/executor.h``: ``TokenRangeRetentionConfig{tokenStart,
tokenEnd, priority, durationMs}`` and ``decodeRetentionPriority`` / ``decodeDurationMs``):
one token range over the prompt's full blocks, and the decode retention (generated blocks),
both ``(hint_max_priority, hold)``, laid over the base plan by the hint rule (a token only
ever gains: :func:`retention.policy.hint_plan.apply_hints`).

Bounded like hints, by the class and the quota (:class:`~retention.policy.hint_plan.HintPolicy`:
``enabled``, ``max_ttl_ms``, ``max_priority``, ``quota_fraction``): the held blocks are counted
in a :class:`~retention.policy.hint_quota.HintLedger` (prompt blocks by their salted hashes,
generated blocks under keys derived from the prompt's last hash, counted as long as they are
held), and the hold stops at the first prompt block the budget has no room for; the decode
retention is given only when the whole prompt and the output's blocks fit.

**A delete cannot revoke.** TensorRT-LLM takes a duration at enqueue and offers no call to
shorten it afterwards (the executor has no retention update for a finished request's
blocks). So a deleted (or expired) stored response "releases" its prefix only as the engine
allows: nothing renews its hold (no continuation can come), the hold runs out on the pool's
own clock, and the blocks fall back to priority 35. The ledger keeps counting them against
the budget until then, exactly as long as the engine holds them. The measured hold is what
bounds the waste of a conversation nobody continues.

**Only while it pays.** A hold is a bet that the held prefix is worth more than what it
pushes out; on a pool of tool loops alone it is LRU's order plus the budget's cuts, and it
lost (``bench/retention/conversation.py``). So the ledger carries a :class:`~retention.policy.hold_duel.HoldDuel`:
every request of the pool is replayed in two sampled shadows of the pool, one with the plan it
gets without the hold and one with the plan it would get held, and the pool holds only while the
held shadow hits measurably more (``ledger.duel = None``: hold every request, the rule above alone).

Pure: the caller passes ``now`` (seconds, any monotonic clock). Memory per tenant: at most
``MAX_RESPONSES`` stored responses (the oldest go first) and ``GAP_SAMPLES`` gaps per kind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from retention.policy.hint_plan import HintPolicy, HintSpan, apply_hints
from retention.policy.hint_quota import GAP_SAMPLES, MIN_GAP_SAMPLES, MIN_HOLD_MS, HintLedger
from retention.policy.hold_duel import HoldDuel, PoolShape
from retention.types import RetentionPlan

GapKind = Literal["tool", "turn"]
MAX_RESPONSES = 65_536  # stored responses tracked per tenant
# The hold covers the median measured gap (margin 1). Chosen on the chat family (a *tune*
# family) among p90×2 (the hint ledger's), p50×1, p50×0.5 and p25×1 (bench/retention/conversation.py
# states the figures); never looked at on the report families.
GAP_QUANTILE = 0.5
GAP_MARGIN = 1.0
_DECODE_KEY = 0x5F3759DF  # mixes a prompt's last hash into keys for its generated blocks


@dataclass(frozen=True, slots=True)
class ConversationRequest:
    """What a request says about its conversation (any API; Responses fills all four)."""

    response_id: str | None = None
    previous_response_id: str | None = None
    store: bool = False
    offers_tools: bool = False

    @property
    def kind(self) -> GapKind | None:
        """The gap this request's prefix waits for: a tool call's, a user's turn, or none."""
        if self.offers_tools:
            return "tool"
        return "turn" if self.store and self.response_id is not None else None


@dataclass(slots=True)
class _Stored:
    at: float  # when it was planned (the continuation's gap is measured from here)
    tools: bool
    live_until: float  # the store's expiry
    root: str  # the first response of its chain (as far as this ledger saw it)


@dataclass(slots=True)
class _TenantConversations:
    responses: dict[str, _Stored] = field(default_factory=dict)  # insertion order = oldest first
    gaps: dict[str, deque[float]] = field(default_factory=lambda: {
        "tool": deque(maxlen=GAP_SAMPLES), "turn": deque(maxlen=GAP_SAMPLES)})


@dataclass(slots=True)
class ConversationLedger:
    """Per tenant: stored responses still live, measured tool and turn gaps; and the held blocks
    (:class:`HintLedger`, the budget's conservative count)."""

    holds: HintLedger = field(default_factory=HintLedger)
    quantile: float = GAP_QUANTILE  # the hold covers this quantile of the kind's gaps ...
    margin: float = GAP_MARGIN  # ... times this margin
    _tenants: dict[str, _TenantConversations] = field(default_factory=dict)
    deleted: int = 0  # deletions of responses the ledger knew
    # Held and unheld shadows of the pool (retention/policy/hold_duel.py); None: always hold.
    duel: HoldDuel | None = field(default_factory=HoldDuel)

    def _tenant(self, tenant: str) -> _TenantConversations:
        return self._tenants.setdefault(tenant, _TenantConversations())

    def continued(self, tenant: str, previous_response_id: str, now: float) -> float | None:
        """A request continues ``previous_response_id``: its gap, if that response is live here."""
        state = self._tenants.get(tenant)
        stored = None if state is None else state.responses.get(previous_response_id)
        if stored is None or stored.live_until <= now or now < stored.at:
            return None
        gap = now - stored.at
        state.gaps["tool" if stored.tools else "turn"].append(gap)
        return gap

    def root(self, tenant: str, response_id: str, now: float) -> str | None:
        """The root of a live stored response's chain (None: unknown, deleted or expired)."""
        state = self._tenants.get(tenant)
        stored = None if state is None else state.responses.get(response_id)
        return None if stored is None or stored.live_until <= now else stored.root

    def stored(self, tenant: str, response_id: str, *, tools: bool, now: float, store_ttl_ms: int,
               root: str | None = None) -> None:
        """A stored response is produced now; it lives ``store_ttl_ms`` unless deleted. ``root``:
        its chain's first response (itself when None)."""
        state = self._tenant(tenant)
        state.responses.pop(response_id, None)
        state.responses[response_id] = _Stored(now, tools, now + store_ttl_ms / 1000.0, root or response_id)
        if len(state.responses) > MAX_RESPONSES:
            expired = [r for r, s in state.responses.items() if s.live_until <= now]
            for r in expired or [next(iter(state.responses))]:
                del state.responses[r]

    def delete(self, tenant: str, response_id: str) -> bool:
        """The client deleted ``response_id``: it is never continued, so nothing renews its hold.
        The hold already sent runs out on the engine's clock (see the module docstring)."""
        state = self._tenants.get(tenant)
        if state is None or state.responses.pop(response_id, None) is None:
            return False
        self.deleted += 1
        return True

    def remaining_ms(self, tenant: str, response_id: str, now: float) -> int | None:
        """How long the stored response still lives (None: unknown, deleted or expired)."""
        state = self._tenants.get(tenant)
        stored = None if state is None else state.responses.get(response_id)
        if stored is None or stored.live_until <= now:
            return None
        return int((stored.live_until - now) * 1000)

    def gap_count(self, tenant: str, kind: GapKind) -> int:
        state = self._tenants.get(tenant)
        return 0 if state is None else len(state.gaps[kind])

    def hold_ms(self, tenant: str, kind: GapKind, cap_ms: int) -> int:
        """``min(cap, max(MIN_HOLD_MS, GAP_MARGIN × quantile))``; 0 (no hold) before enough gaps."""
        state = self._tenants.get(tenant)
        gaps = None if state is None else state.gaps[kind]
        if gaps is None or len(gaps) < MIN_GAP_SAMPLES:
            return 0
        ordered = sorted(gaps)
        gap = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        return min(cap_ms, max(MIN_HOLD_MS, int(self.margin * gap * 1000)))


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """A plan after the conversation hold; ``hold_ms`` 0 when none applied."""

    plan: RetentionPlan
    kind: GapKind | None = None
    hold_ms: int = 0
    held_blocks: int = 0  # prompt blocks held
    decode_held: bool = False
    clipped: bool = False  # the budget cut the hold short
    recorded: tuple[int, ...] = ()  # the budget keys held (prompt hashes, then generated blocks' keys)

    def released(self, ledger: ConversationLedger, tenant: str, now: float) -> None:
        """The request ended: TensorRT-LLM starts a duration at release, so count the hold from ``now``."""
        if self.recorded:
            ledger.holds.record(tenant, self.recorded, [self.hold_ms] * len(self.recorded), now)


def decode_keys(hashes: Sequence[int], output_blocks: int) -> tuple[int, ...]:
    """Budget keys for a request's generated blocks (never equal to a prompt hash in practice;
    they only count, they never match a cached block)."""
    last = hashes[-1] if hashes else 0
    return tuple(hash((_DECODE_KEY, last, i)) for i in range(output_blocks))


def plan_conversation(plan: RetentionPlan, request: ConversationRequest, caps: HintPolicy, *, total: int,
                      output_tokens: int, tokens_per_block: int, hashes: Sequence[int], ledger: ConversationLedger,
                      tenant: str, budget_blocks: int, now: float, store_ttl_ms: int,
                      shape: PoolShape | None = None) -> ConversationPlan:
    """``plan`` with the conversation hold (module docstring), within ``caps`` and ``budget_blocks``.

    Call it for *every* request of the pool (one without conversation fields passes
    ``ConversationRequest()``): the hold duel's shadows must see the whole pool's traffic.
    ``shape``: the pool's, for the duel's shadows (None: no duel replay).

    Records the request in ``ledger`` whatever comes of it (a continuation's gap, a stored
    response). Returns ``ConversationPlan(plan)`` (the same plan object) when no hold
    applies: the class's hints off, a demoted plan, neither tools nor a stored response, the
    hold duel's arm is "never" (:mod:`retention.policy.hold_duel`), or no room in the budget.
    """
    root = None
    if request.previous_response_id is not None:
        root = ledger.root(tenant, request.previous_response_id, now)
        ledger.continued(tenant, request.previous_response_id, now)
    if request.store and request.response_id is not None:
        ledger.stored(tenant, request.response_id, tools=request.offers_tools, now=now, store_ttl_ms=store_ttl_ms,
                      root=root or request.response_id)
    kind = request.kind
    hold = 0
    if kind is not None and caps.enabled and not plan.demoted:
        cap = caps.max_ttl_ms
        if request.store and request.response_id is not None:
            cap = min(cap, store_ttl_ms)  # nobody can continue it once the store forgets it
        hold = ledger.hold_ms(tenant, kind, cap)
    duel = ledger.duel
    if duel is not None and shape is not None:
        always = plan
        if hold > 0:
            always = _held(plan, caps, hold, kind, total=total, output_tokens=output_tokens,
                           tokens_per_block=tokens_per_block, hashes=hashes, holds=duel.budget, tenant=tenant,
                           budget_blocks=budget_blocks, now=now).plan
        duel.record(shape, hashes, plan, always, now=now, num_tokens=total, tokens_per_block=tokens_per_block)
    if hold <= 0 or (duel is not None and not duel.holds()):
        return ConversationPlan(plan, kind)
    return _held(plan, caps, hold, kind, total=total, output_tokens=output_tokens, tokens_per_block=tokens_per_block,
                 hashes=hashes, holds=ledger.holds, tenant=tenant, budget_blocks=budget_blocks, now=now)


def _held(plan: RetentionPlan, caps: HintPolicy, hold: int, kind: GapKind | None, *, total: int, output_tokens: int,
          tokens_per_block: int, hashes: Sequence[int], holds: HintLedger, tenant: str, budget_blocks: int,
          now: float) -> ConversationPlan:
    """``plan`` held for ``hold`` ms as far as ``holds`` has room within ``budget_blocks`` (recorded there)."""
    full = min(len(hashes), total // tokens_per_block)
    allowed = holds.allowance(tenant, list(hashes[:full]), budget_blocks, now)
    clipped = allowed < full
    if allowed == 0:
        return ConversationPlan(plan, kind, clipped=clipped)
    kept = tuple(hashes[:allowed])
    holds.record(tenant, kept, [hold] * allowed, now)
    held = apply_hints(plan, (HintSpan(0, allowed * tokens_per_block, hold),), caps, total)
    outputs = decode_keys(hashes, -(-output_tokens // tokens_per_block))
    decode = not clipped and bool(outputs) and holds.allowance(tenant, outputs, budget_blocks, now) == len(outputs)
    if decode and caps.max_priority >= held.decode_priority:
        holds.record(tenant, outputs, [hold] * len(outputs), now)
        kept = kept + outputs
        # The hint rule for the generated blocks: a higher priority takes the hold; at equal
        # priority the longer duration wins (None, never expiring, is longest).
        duration: int | None = hold
        if caps.max_priority == held.decode_priority:
            duration = None if held.decode_duration_ms is None else max(hold, held.decode_duration_ms)
        held = RetentionPlan(held.ranges, caps.max_priority, duration, demoted=held.demoted)
    else:
        decode = False
    return ConversationPlan(held, kind, hold, allowed, decode, clipped, kept)


__all__ = ["ConversationLedger", "ConversationPlan", "ConversationRequest", "GapKind", "decode_keys",
           "plan_conversation"]
