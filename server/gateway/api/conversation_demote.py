"""Demote on delete: after ``DELETE /v1/responses/{id}``, one engine request re-claims the deleted
conversation's own cached blocks at priority 0 — or, on a pool with a host tier, at its offload
threshold (``demote_priority``: first out of the GPU, but to host) — (:mod:`retention.policy.demote`).

TensorRT-LLM cannot revoke a retention given at enqueue, but a request that reuses cached
blocks re-sets them (``WindowBlockManager::loadOrAllocateBlocks`` claims each matched block
with the request's per-block retention; ``LRUEvictionPolicy::claimBlock`` overrides the
priority, lower ones too, and replaces the duration). So the gateway rebuilds the deleted
response's prompt from the store *before* deleting it (the stored chain's items without the
response's own output, its instructions and tools, rendered as the Responses route renders
them), and after the delete sends::

    input_ids       the prompt cut to its cached full blocks + 1 token (demote_length)
    max_new_tokens  1
    retention       the tenant's normal plan before the first block no other live stored
                    response of the conversation holds (and past the system segment), then
                    TokenRangeRetentionConfig(start, None, priority P, no duration),
                    decode priority P (P = 0, or the pool's offload threshold with a host tier)

The cached depth comes from the pool router's KV-event indexes (the deepest replica; a
router without indexes gives no depth, and then nothing is sent: an uncut demote would
prefill an evicted tail only to discard it, which the simulator measured as a loss). The
demote goes only to a replica whose index holds that whole depth (the router's cost picks
among several), never by the cost to another one, where it would prefill the prefix at demote
priority and leave the real blocks as they were; when no holder can take a request (draining,
breaker open) nothing is sent (outcome ``holder_unavailable``).
What is still held, and what the delete orphans, is read from the response store, not from
this process's memory, so a gateway restarted since the conversation was stored, or another
gateway sharing the registry, demotes the same blocks. Every stored row keeps its
conversation's ``root_id`` and its prompt's block hashes; a delete reads the conversation's
live rows and (:mod:`retention.policy.demote`):

* ``orphaned``: the deleted response and its descendants can no longer be continued (a
  continuation rebuilds the whole chain, and a link is gone), so each orphaned *leaf*'s prompt
  (at most ``MAX_LEAVES``, the newest) is rebuilt before the delete and demoted;
* ``demote_start``: each from past the longest prefix it shares with a live row outside the
  orphaned subtree (a row whose blocks are unknown counts as holding all of them), and
  never inside the system segment: other conversations of the tenant are not read (that
  would be every stored row) and what they can share with this one is that segment (same
  instructions and tools).

A row stored before the store kept block hashes falls back to the process's
:class:`~retention.policy.demote.DemoteLedger` (the deleted response alone). Only for a class
with ``conversation_hold_enabled`` (the switch of the conversation hold). Fire and forget: the
DELETE answers at once; a demote is not tenant usage (no admission, no billing)
and is counted in ``kvgate_conversation_demotes_total`` by trigger (``delete``) and outcome.

**The end of a run.** A stored Responses request that offered tools and is answered with a
message, not a function call, most likely ended its agent's run (the simulator's ``X+end``,
:mod:`retention.simulation.conversational`; its figures in ``bench/retention/conversation.py``'s section
of docs/benchmarks.md). Its response stays stored, but the same kind of demote is sent for its
own prompt (the engine saw it; nothing is rebuilt), in the background once the row is stored
(:meth:`Demotes.spawn_end`, trigger ``end``; it waits up to ``END_INDEX_WAIT_S`` for the
KV-event index to show this turn's blocks, then cuts as above), where the class has
``conversation_end_demote_enabled``: its own switch, independent of ``conversation_hold_enabled``
and of the hold's duel (with both on, every ended run is demoted; the simulator's ungated
``+conv+end`` beat the duel-gated one). Its range (:func:`~retention.policy.demote.end_start`)
starts past the system segment and past what any live stored row of *another* conversation of
the tenant holds (the newest ``MAX_OTHER_ROWS`` of them; older ones, and rows without block hashes, are
taken to share the system segment only, as the delete path takes them); the run's own
earlier responses protect nothing, since the run is over.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from engines.contract import SamplingParams
from retention.hashing import block_hashes
from retention.policy.demote import (MAX_LEAVES, Doomed, demote_length, demote_plan, demote_priority, doomed,
                                     end_start)
from server.gateway.api.completions import CompletionJob, build_plan, engine_request
from server.gateway.api.prompting import PreparedPrompt
from server.gateway.api.responses_convert import convert
from server.gateway.api.responses_schemas import ResponsesRequest
from server.gateway.errors import ServingError

log = logging.getLogger(__name__)
# ``services`` is a GatewayServices and ``tenant`` a TenantContext: typed Any, since services.py imports this module.
_BODY_FIELDS = ("model", "instructions", "tools", "tool_choice")  # what shapes the rendered prompt
MAX_OTHER_ROWS = 1024  # other conversations' rows an end-of-run demote reads (the newest)
END_INDEX_WAIT_S = 3.0  # at most this long for the KV-event index to show an ended run's prompt (polled ~1 s)
END_INDEX_STEP_S = 0.1


@dataclass(frozen=True, slots=True)
class DeletedPrompt:
    """A prompt to demote (the deleted response's, or an orphaned descendant's) as the engine saw
    it, its full blocks' hashes, and what the delete leaves alive in the conversation (None: the
    store does not know the blocks, the row predates stored block hashes)."""

    model: str
    prompt: PreparedPrompt
    tokenizer: Any  # ChatTokenizer
    hashes: tuple[int, ...]
    doomed: Doomed | None = None

    def start_block(self, tokens_per_block: int, local: int | None) -> int | None:
        """The first block to demote: from the store's rows, else ``local`` (the process's ledger)."""
        if self.doomed is None:
            return local
        return self.doomed.start(self.hashes, protected_blocks=self.prompt.system_end // tokens_per_block)


async def _rebuild(services: Any, tenant: Any, response_id: str) -> tuple[str, PreparedPrompt, Any]:
    """The response's prompt as its request rendered it: the stored chain's items without its own
    output, with its instructions and tools (raises when the chain is broken or will not render)."""
    store = services.responses
    stored = await store.get(tenant_id=tenant.tenant_id, response_id=response_id)
    chain = await store.chain(tenant_id=tenant.tenant_id, response_id=response_id)
    output = len(stored.get("output") or ())
    items = chain.items[:len(chain.items) - output]
    body = ResponsesRequest.model_validate({**{k: stored[k] for k in _BODY_FIELDS if stored.get(k) is not None},
                                            "input": items})
    prompter = await services.engines.prompter(tenant.pool)
    return body.model, prompter.chat(convert(body, items).messages), prompter.tokenizer


async def doomed_prompts(services: Any, tenant: Any, response_id: str) -> list[DeletedPrompt]:
    """Read before the delete: the prompts it leaves dead (the module docstring); empty when the
    response is unknown (the delete answers 404) or nothing can be rendered again. Raises the
    store's 503 ``registry_unavailable`` when the registry is out of reach: the delete is not
    made (it could not be either), and the client's retry demotes once the registry is back."""
    try:
        rows = await services.responses.conversation_rows(tenant_id=tenant.tenant_id, response_id=response_id)
    except ServingError as exc:
        if exc.status >= 500:
            raise
        return []
    own = next((r for r in rows if r.id == response_id), None)
    found: Doomed | None = None
    if own is None or own.prompt_blocks is None:  # stored before block hashes were kept: this process's ledger
        leaves = [response_id]
    else:
        # The rule the simulator's ``+conv+demote`` replays (retention.policy.demote.doomed); a live
        # row whose blocks are unknown may hold any of them: it counts as holding everything.
        found = doomed(((r.id, r.previous_response_id, r.prompt_blocks) for r in rows), response_id,
                       max_leaves=MAX_LEAVES)
        leaves = list(found.leaves)
    out = []
    for leaf in leaves:
        try:
            model, prompt, tokenizer = await _rebuild(services, tenant, leaf)
        except (ServingError, ValueError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
            if isinstance(exc, ServingError) and exc.status >= 500:
                raise  # the registry went away meanwhile: no delete now (see above)
            log.info("no demote for %s: %s", leaf, exc)
            continue
        hashes = tuple(block_hashes(prompt.input_ids, tenant.pool.tokens_per_block, salt=tenant.engine_salt))
        out.append(DeletedPrompt(model, prompt, tokenizer, hashes, found))
    return out


def replica_depths(services: Any, tenant: Any, hashes: tuple[int, ...], now: float) -> dict[int, int] | None:
    """Per replica id of the pool, the cached prefix of ``hashes`` (blocks, KV-event indexes), or
    None when the pool's router keeps no index."""
    route = services.routing.route(tenant.pool)
    match = getattr(route.router, "match", None)
    if match is None or not route.replicas:
        return None
    return {r: m.gpu_blocks + m.host_blocks for r, m in ((r, match(r, hashes, now=now)) for r in route.replicas)}


def cached_blocks(services: Any, tenant: Any, hashes: tuple[int, ...], now: float) -> int | None:
    """The deepest cached prefix of ``hashes`` over the pool's replicas (KV-event indexes), or
    None when the pool's router keeps no index."""
    depths = replica_depths(services, tenant, hashes, now)
    return None if depths is None else max(depths.values())


async def send_demote(services: Any, tenant: Any, deleted: DeletedPrompt, start_block: int) -> str:
    """One demote request, drained; returns the outcome counted in the metric.

    It goes only to a replica whose index holds the whole cut (the deepest cached prefix), never
    by the ordinary cost to another one: there it would prefill the prefix at demote priority and
    leave the blocks it is meant for as they were. When no such replica can take a request now
    (draining, breaker open), nothing is sent (``holder_unavailable``)."""
    now = time.monotonic()  # the routing indexes' clock (Routing's default)
    prompt, tpb = deleted.prompt, tenant.pool.tokens_per_block
    depths = replica_depths(services, tenant, deleted.hashes, now)
    if depths is None:
        return "no_cache_view"
    depth = max(depths.values())
    length = demote_length(depth, start_block * tpb, tpb, prompt.total)
    if length is None:
        return "uncached"
    route = services.routing.route(tenant.pool)
    holders = {rid for rid, held in depths.items()
               if held >= depth and rid in route.replicas and route.replicas[rid].routable}
    if not holders:
        return "holder_unavailable"
    cut = replace(prompt, input_ids=prompt.input_ids[:length], system_end=min(prompt.system_end, length),
                  context_end=min(prompt.context_end, length), marks=())
    job = CompletionJob(
        tenant=tenant, kind="chat", model=deleted.model,
        prompt=cut, max_new_tokens=1, sampling=SamplingParams(temperature=0.0), stop=(), stream=False,
        include_usage=False, tokenizer=deleted.tokenizer,
        engine=services.routing.engine(services.engines.seen(tenant.pool), only=holders),
        quota=services.monitor.quota_state(tenant.pool.name, tenant.tenant_id),
    )
    pool = tenant.pool  # with a host tier the demoted blocks go there first (demote_priority)
    at = demote_priority(pool.secondary_blocks, pool.secondary_offload_min_priority)
    request = engine_request(job, demote_plan(build_plan(job), start_block * tpb, at))
    try:
        async for _ in job.engine.generate(request, request_id="demote-" + secrets.token_hex(6),
                                           hashes=list(deleted.hashes[:length // tpb])):
            pass
    except Exception as exc:  # noqa: BLE001 - fire and forget: the delete has answered already
        log.warning("demote after deleting a stored response failed: %s", exc)
        return "failed"
    return "sent"


async def end_of_run(services: Any, tenant: Any, ended: DeletedPrompt, root_id: str) -> str | None:
    """The demote for a run that ended in a message (the module docstring's "end of a run"): its
    prompt from the first block no other conversation's live stored response holds; None when
    every block is shared or protected (nothing sent, nothing counted)."""
    try:
        rows = await services.responses.other_conversations(tenant_id=tenant.tenant_id, root_id=root_id,
                                                            limit=MAX_OTHER_ROWS)
    except Exception as exc:  # noqa: BLE001 - fire and forget: the client has its answer already
        log.warning("no end-of-run demote: the response store could not be read: %s", exc)
        return "failed"
    tpb = tenant.pool.tokens_per_block
    start = end_start(ended.hashes, rows, root_id, protected_blocks=ended.prompt.system_end // tpb)
    if start is None:
        return None
    # The engine reports the prompt's new blocks through the KV events the pool monitor polls (~1 s):
    # wait (bounded) until the index shows them, else the cut would leave this turn's tail unclaimed.
    deadline = time.monotonic() + END_INDEX_WAIT_S
    while time.monotonic() < deadline:
        depth = cached_blocks(services, tenant, ended.hashes, time.monotonic())
        if depth is None or depth >= len(ended.hashes):
            break
        await asyncio.sleep(END_INDEX_STEP_S)
    return await send_demote(services, tenant, ended, start)


@dataclass(slots=True)
class Demotes:
    """The demote tasks in flight (kept so they are not collected before they finish)."""

    _tasks: set[asyncio.Task] = field(default_factory=set)

    def _run(self, services: Any, tenant: Any, trigger: str, work: Any) -> None:
        async def run() -> None:
            outcome = await work
            if outcome is not None:
                services.metrics.conversation_demotes.labels(tenant.slug, tenant.pool.name, trigger, outcome).inc()

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def spawn(self, services: Any, tenant: Any, deleted: DeletedPrompt, start_block: int) -> None:
        """After a delete: one demote from ``start_block`` (counted with trigger ``delete``)."""
        self._run(services, tenant, "delete", send_demote(services, tenant, deleted, start_block))

    def spawn_end(self, services: Any, tenant: Any, ended: DeletedPrompt, root_id: str) -> None:
        """After a run ended in a message: :func:`end_of_run` (counted with trigger ``end``)."""
        self._run(services, tenant, "end", end_of_run(services, tenant, ended, root_id))

    async def settle(self) -> None:
        """Wait for the demotes in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
