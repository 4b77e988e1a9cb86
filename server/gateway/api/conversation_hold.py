"""The request core's conversation and tool-loop hold: the pure policy, one ledger per pool.

A request that offers tools (any dialect) or stores its Responses answer is held at its
class's hint priority for the tenant's measured gap (:mod:`retention.policy.conversation`),
prompt and decode retention, within the class's hint caps and the *same* hint budget as the
client's cache hints (one :class:`~retention.policy.hint_quota.HintLedger` per pool counts
both, so together they never exceed ``hint_quota_fraction``). ``DELETE /v1/responses/{id}``
tells the ledger, which stops measuring and renewing that conversation; what the engine was
already told runs out on its own clock (TensorRT-LLM takes durations at enqueue only); a
demote request may then re-claim what is still cached of it at priority 0
(:mod:`server.gateway.api.conversation_demote`): the per-pool :class:`DemoteLedger` here
knows which prompt blocks other live stored responses of the tenant still hold.

Whether the hold is in force is decided per pool by the ledger's hold duel
(:mod:`retention.policy.hold_duel`): once a pool has a ledger, the request core shows every
request of that pool to it (:meth:`ConversationHolds.plan` for those that may be held,
:meth:`ConversationHolds.shadow` for the rest), and two sampled shadows of the pool, one held
and one not, decide whether holding pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from retention.policy.conversation import ConversationLedger, ConversationPlan, ConversationRequest, plan_conversation
from retention.policy.demote import DemoteLedger
from retention.policy.hint_quota import HintLedger
from retention.policy.hold_duel import HOLD_DUEL, HoldDuel, PoolShape
from retention.shadow.duel import DuelConfig
from retention.types import RetentionPlan
from tenants.snapshots import PoolSnapshot

# A job is server.gateway.api.completions.CompletionJob (not imported: completions imports this module).
CompletionJob = Any

STORE_TTL_MS = 30 * 24 * 3600 * 1000  # the response store's default TTL (server.gateway.response_store)


def conversation_of(job: CompletionJob) -> ConversationRequest:
    """What the job says about its conversation: the dialect's (Responses), else tools offered or not."""
    offers = job.tools is not None
    if job.conversation is not None:
        return ConversationRequest(job.conversation.response_id, job.conversation.previous_response_id,
                                   job.conversation.store, job.conversation.offers_tools or offers)
    return ConversationRequest(offers_tools=offers)


@dataclass(slots=True)
class ConversationHolds:
    """Per pool: the conversation ledger, sharing the pool's hint ledger (one budget)."""

    store_ttl_ms: int = STORE_TTL_MS
    duel: DuelConfig | None = HOLD_DUEL  # None: every eligible request held (no duel)
    _ledgers: dict[str, ConversationLedger] = field(default_factory=dict)
    _demotes: dict[str, DemoteLedger] = field(default_factory=dict)  # pool -> live stored prompts' blocks

    def ledger(self, pool: str, hints: HintLedger) -> ConversationLedger:
        ledger = self._ledgers.get(pool)
        if ledger is None:
            duel = None if self.duel is None else HoldDuel(self.duel)
            ledger = self._ledgers[pool] = ConversationLedger(holds=hints, duel=duel)
        return ledger

    def applies(self, job: CompletionJob) -> bool:
        """Whether the job may be held: its class's conversation-hold switch is on (whatever its hint
        switch says) and it offers tools or is a stored conversation."""
        conv = conversation_of(job)
        return job.tenant.conversation_hold and (conv.kind is not None or conv.previous_response_id is not None)

    def plan(self, job: CompletionJob, plan: RetentionPlan, hashes: list[int], hints: HintLedger,
             now: float) -> ConversationPlan:
        tenant = job.tenant
        conv = conversation_of(job)
        if conv.store and conv.response_id is not None:
            full = hashes[:min(len(hashes), job.prompt.total // tenant.pool.tokens_per_block)]
            self._demotes.setdefault(tenant.pool.name, DemoteLedger()).stored(
                tenant.engine_tenant_id, conv.response_id, full)
        budget = tenant.hints.budget_blocks(tenant.kv_quota_fraction, tenant.pool.primary_blocks)
        # The class's own switch, within its hint caps: the policy reads ``enabled`` from the caps.
        caps = replace(tenant.hints, enabled=tenant.conversation_hold)
        return plan_conversation(plan, conversation_of(job), caps, total=job.prompt.total,
                                 output_tokens=job.max_new_tokens, tokens_per_block=tenant.pool.tokens_per_block,
                                 hashes=hashes, ledger=self.ledger(tenant.pool.name, hints),
                                 tenant=tenant.engine_tenant_id, budget_blocks=budget, now=now,
                                 store_ttl_ms=self.store_ttl_ms, shape=_shape(tenant.pool))

    def watches(self, pool: str) -> bool:
        """Whether the pool's hold duel must see its other requests too (:meth:`shadow`)."""
        ledger = self._ledgers.get(pool)
        return ledger is not None and ledger.duel is not None

    def shadow(self, job: CompletionJob, plan: RetentionPlan, hashes: list[int], hints: HintLedger,
               now: float) -> None:
        """A request of a watched pool that cannot be held: replayed as it is in both of the duel's shadows."""
        duel = self.ledger(job.tenant.pool.name, hints).duel
        if duel is not None:
            duel.record(_shape(job.tenant.pool), hashes, plan, plan, now=now, num_tokens=job.prompt.total,
                        tokens_per_block=job.tenant.pool.tokens_per_block)

    def released(self, job: CompletionJob, held: ConversationPlan | None, now: float) -> None:
        """The request ended: its hold is counted from now (durations start at release)."""
        ledger = self._ledgers.get(job.tenant.pool.name)
        if held is not None and ledger is not None:
            held.released(ledger, job.tenant.engine_tenant_id, now)

    def deleted(self, pool: str, tenant: str, response_id: str) -> bool:
        """A stored response was deleted: its conversation is no longer measured or renewed."""
        ledger = self._ledgers.get(pool)
        return ledger is not None and ledger.delete(tenant, response_id)

    def demote_start(self, pool: str, tenant: str, response_id: str) -> int | None:
        """After a delete: the first prompt block no other live stored response of the tenant
        holds (None: unknown here, or nothing of its own)."""
        demotes = self._demotes.get(pool)
        return None if demotes is None else demotes.delete(tenant, response_id)


def _shape(pool: PoolSnapshot) -> PoolShape:
    """The pool's shape for the hold duel's shadows."""
    return PoolShape(pool.primary_blocks, pool.secondary_blocks, pool.secondary_offload_min_priority)
