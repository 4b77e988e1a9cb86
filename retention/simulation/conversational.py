"""``<policy>+conv``: any simulator policy with the conversation and tool-loop hold on top.

The wrapped policy plans first; then every request that offers tools or stores its
response goes through the very code the gateway runs
(:func:`retention.policy.conversation.plan_conversation`): held at the class's hint priority
for the tenant's measured tool or turn gap, within the class's hint rules and its hint
budget (the class's ``quota_fraction`` of the tenant's quota share of the GPU blocks).
Requests without those fields are planned by the wrapped policy alone, so ``X`` and
``X+conv`` differ only where conversations are.

Deletions (the trace's ``delete_response`` events) reach the policy's ledger through
:meth:`ConversationPolicy.on_delete`: the engine cannot revoke a duration it was given at
enqueue, so neither can the simulated pool. With ``demote`` (``X+conv+demote``) a delete
also becomes the gateway's *demote requests* (:mod:`retention.policy.demote`), by the gateway's
rule (:func:`~retention.policy.demote.doomed`, over the conversation's parent links kept from
the replayed ``previous_response_id`` chains): the simulator replays each orphaned leaf's
prompt through the same pool with :meth:`ConversationPolicy.demote_request`'s plan (the
wrapped policy's plan for that request up to the prefix the conversation's rows outside the
orphaned subtree share, and never inside the leaf's system segment; priority 0 with no
expiry past it); they are counted apart, never in the hit rate. With ``end_demote``
(``X+conv+end``) a request that offered tools and whose response is a message, not a function call (the trace's
``output_kind``, known to the gateway at completion), ended its run: when it completes, the
same kind of demote request re-claims its conversation's own blocks (those no other
conversation's live stored response holds) at priority 0, through the hold duel (only where
the duel holds). ``X+end`` is that demote without the hold: ``X``'s
plans unchanged (the ledger only follows the chains, under :data:`~retention.policy.hint_plan.HINTS_OFF`),
and every run that ends in a message demoted, since there is no duel to gate it. Generated blocks are not cached
in the simulator (a trace line's output has no hash ids), so the decode retention costs
budget here and earns nothing: the simulated gain is the prompt's alone.

Rules: with ``--classes`` each class's ``hints`` entry (absent = off); without,
:data:`~retention.simulation.layered.SIM_HINTS` (at most 1 h, at priority 60, held blocks at
most half of the tenant's share, which is the whole pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retention.policy.conversation import ConversationLedger, ConversationPlan, ConversationRequest, plan_conversation
from retention.policy.hold_duel import PoolShape
from retention.policy.demote import DEMOTE_PRIORITY, DemoteLedger, continuable, demote_plan, doomed
from retention.policy.hint_plan import HINTS_OFF
from retention.simulation.layered import LayeredPolicy
from retention.trace import ResponseDeletion, TraceRequest
from retention.types import RetentionPlan

SUFFIX = "+conv"
DEMOTE_SUFFIX = "+demote"
END_SUFFIX = "+end"
MAX_STORED = 65_536  # stored requests kept for demotes (the oldest are forgotten)
STORE_TTL_MS = 30 * 24 * 3600 * 1000  # the response store's default (OpenAI keeps stored responses 30 days)


def conversation_request(request: TraceRequest) -> ConversationRequest:
    return ConversationRequest(request.response_id, request.previous_response_id, request.store, request.offers_tools)


@dataclass(slots=True)
class ConversationPolicy(LayeredPolicy):
    ledger: ConversationLedger = field(default_factory=ConversationLedger)
    store_ttl_ms: int = STORE_TTL_MS
    held_requests: int = 0  # requests whose plan the hold changed
    end_demotes: int = 0  # runs ended in a message whose own blocks were demoted
    clipped_requests: int = 0  # requests whose hold the budget cut short
    label: str | None = None
    demote: bool = False  # a delete becomes a demote request (module docstring)
    demotes: DemoteLedger = field(default_factory=DemoteLedger)
    # A tool-offering response that ends in a message (not a function call) ends its run: its
    # conversation's own blocks are demoted at completion (module docstring). "duel": only while
    # the hold duel holds; "always": whatever the duel says.
    end_demote: str | None = None
    hold: bool = True  # False (``X+end``): never hold, the wrapped policy's plan goes out unchanged
    _chains: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (tenant, root) -> its response ids
    _ending: dict[int, tuple[TraceRequest, RetentionPlan, str]] = field(default_factory=dict)  # index -> (request, plan, root)
    # (tenant, response id) -> (the stored request, its hashes, the wrapped policy's plan for it, its root)
    _stored: dict[tuple[str, str], tuple[TraceRequest, tuple[int, ...], RetentionPlan, str]] = field(
        default_factory=dict)
    # (tenant, root) -> its live stored responses' parent links, oldest first: the store's conversation rows
    _rows: dict[tuple[str, str], dict[str, str | None]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if not self.hold:
            return self.label or self.inner.name + END_SUFFIX  # type: ignore[attr-defined]
        return self.label or (self.inner.name + SUFFIX + (DEMOTE_SUFFIX if self.demote else "")  # type: ignore[attr-defined]
                              + (END_SUFFIX if self.end_demote == "duel" else ""))

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        plan = self.inner.plan(request, hashes, now=now, pool=pool)  # type: ignore[attr-defined]
        conv = conversation_request(request)  # every request, so that the hold duel's shadows see the pool
        rules = self.rules_for(request)
        cfg = pool.config
        if (self.demote or self.end_demote) and request.store and request.response_id is not None and rules.enabled:
            tenant = request.tenant or ""
            full = tuple(hashes[:min(len(hashes), request.input_length // cfg.tokens_per_block)])
            self.demotes.stored(tenant, request.response_id, full)
            key = (tenant, request.response_id)
            self._forget(key)
            prev = request.previous_response_id
            parent = None if prev is None else self._stored.get((tenant, prev))
            root = request.response_id if parent is None else parent[3]  # the store's root_id: its chain's first
            self._stored[key] = (request, full, plan, root)
            self._rows.setdefault((tenant, root), {})[request.response_id] = prev
            if len(self._stored) > MAX_STORED:
                self._forget(next(iter(self._stored)))
        budget = self.budget_blocks(rules, request, cfg.primary_blocks)
        # Without the hold the ledger still follows the chains (roots, stored responses) for the end demote.
        out = plan_conversation(plan, conv, rules if self.hold else HINTS_OFF, total=request.input_length,
                                output_tokens=request.output_length,
                                tokens_per_block=cfg.tokens_per_block, hashes=hashes, ledger=self.ledger,
                                tenant=request.tenant or "", budget_blocks=budget, now=now,
                                store_ttl_ms=self.store_ttl_ms,
                                shape=PoolShape(cfg.primary_blocks, cfg.secondary_blocks, cfg.secondary_offload_min_priority))
        self.held_requests += out.plan is not plan
        self.clipped_requests += out.clipped
        if self.end_demote and request.response_id is not None and request.store and rules.enabled:
            self._track_end(request, plan, out, now)
        return out.plan

    def _forget(self, key: tuple[str, str]) -> tuple[TraceRequest, tuple[int, ...], RetentionPlan, str] | None:
        """The stored response ``key`` is gone (deleted, replaced or forgotten): out of its conversation's rows."""
        stored = self._stored.pop(key, None)
        if stored is not None:
            rows = self._rows.get((key[0], stored[3]))
            if rows is not None:
                rows.pop(key[1], None)
                if not rows:
                    del self._rows[(key[0], stored[3])]
        return stored

    def _track_end(self, request: TraceRequest, plan: RetentionPlan, out: ConversationPlan, now: float) -> None:
        tenant = request.tenant or ""
        root = self.ledger.root(tenant, request.response_id, now) or request.response_id
        chain = self._chains.setdefault((tenant, root), [])
        chain.append(request.response_id)
        if len(self._chains) > MAX_STORED:
            del self._chains[next(iter(self._chains))]
        duel = self.ledger.duel
        gated = self.end_demote == "duel" and duel is not None and not duel.holds()
        if request.offers_tools and request.output_kind == "message" and not gated:
            self._ending[request.index] = (request, plan, root)

    def completion_demote(self, request: TraceRequest, *, now: float, tokens_per_block: int,
                          priority: int = DEMOTE_PRIORITY) -> tuple[TraceRequest, RetentionPlan] | None:
        """After the request is released: the demote request for a run that ended in a message
        (``end_demote``), or None. Its range starts at the first block no other conversation's
        live stored response holds (the run's own earlier responses are still stored)."""
        ending = self._ending.pop(request.index, None)
        if ending is None:
            return None
        request, plan, root = ending
        tenant = request.tenant or ""
        start = self.demotes.chain_start(tenant, request.response_id, self._chains.get((tenant, root), ()))
        if start is None:
            return None
        self.end_demotes += 1
        return request, demote_plan(plan, start * tokens_per_block, priority)

    def on_delete(self, deletion: ResponseDeletion, *, now: float) -> None:
        self.ledger.delete(deletion.tenant or "", deletion.response_id)

    def demote_request(self, deletion: ResponseDeletion, *, now: float, tokens_per_block: int,
                       priority: int = DEMOTE_PRIORITY) -> list[tuple[TraceRequest, RetentionPlan]]:
        """After :meth:`on_delete`: the requests to replay for this delete, as the gateway sends them
        (``server/gateway/api/conversation_demote.py``), through the same rule
        (:func:`~retention.policy.demote.doomed`): one per orphaned leaf of the deleted response's
        conversation (the newest ``MAX_LEAVES``) whose chain can still be rebuilt before the delete,
        each from past what the conversation's rows outside the orphaned subtree hold and past the
        leaf's system segment. Empty: demote off, the response unknown, or nothing left to demote.

        Only the deleted response leaves the rows (the store deletes that row alone): its orphaned
        descendants stay live rows until they are deleted or forgotten, and a later delete among
        them finds its chain broken and demotes nothing, as the gateway's rebuild fails.
        """
        if not self.demote:
            return []
        tenant = deletion.tenant or ""
        self.demotes.delete(tenant, deletion.response_id)  # the end demote's per-tenant counts follow the store
        key = (tenant, deletion.response_id)
        deleted = self._stored.get(key)
        if deleted is None:
            return []
        parents = dict(self._rows.get((tenant, deleted[3]), {}))
        found = doomed(((rid, prev, self._stored[(tenant, rid)][1]) for rid, prev in parents.items()),
                       deletion.response_id)
        out = []
        for leaf in found.leaves:
            stored = self._stored.get((tenant, leaf))
            if stored is None or not continuable(parents, leaf):
                continue  # the gateway cannot rebuild its prompt either: nothing sent
            request, hashes, plan, _ = stored
            start = found.start(hashes, protected_blocks=(request.system_tokens or 0) // tokens_per_block)
            if start is not None:
                out.append((request, demote_plan(plan, start * tokens_per_block, priority)))
        self._forget(key)
        return out
