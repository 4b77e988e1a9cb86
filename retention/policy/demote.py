"""Demote on delete: a deleted conversation's own blocks released at priority 0 by one reuse.

TensorRT-LLM cannot revoke a retention given at enqueue, but a request that *reuses* cached
blocks re-sets them: ``WindowBlockManager::loadOrAllocateBlocks``
(``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``) claims every matched block with the
request's per-block retention (``mEvictionPolicy->claimBlock(matchingBlock,
perBlockRetentions[bi].retentionPriority, perBlockRetentions[bi].durationMs)``), and
``LRUEvictionPolicy::claimBlock`` (``cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp``)
overrides the priority when one is given (lower ones too: "New priority values always
override the previous value") and replaces the duration; on release the block goes to the
free queue of that priority (``releaseBlock`` → ``addToFreeBlockQueue``), and a block with
no duration never expires back to 35. So one request carrying the deleted conversation's
prompt, with ``TokenRangeRetentionConfig(start, None, 0, None)`` over the conversation's own
tokens, puts them first in line for eviction when it ends. The prompt is cut to its cached
full blocks plus one token (:func:`demote_length`): an evicted tail is not prefilled again
just to be thrown away, so the cost is one computed prompt token and one generated token.

Which tokens are the conversation's own: the blocks no *other* live stored response of the
tenant contains. :class:`DemoteLedger` counts, per tenant, how many live stored responses
hold each full prompt block (chained hashes, so a block's count is at least its
descendants'); on a delete the counts drop, and the demote range starts at the first block
whose count reaches 0. Deleting a chain's responses oldest first therefore demotes nothing
until the last one (each earlier prompt is inside a later, still live one), and then the
whole chain past the prefix it shares with other conversations (the system and tools
segment, a forked history). Blocks before the range keep the tenant's normal plan: a block
no range covers would keep its priority but lose its duration (``KvCacheRetentionConfig::
getPerBlockRetentionPriorityDuration`` gives it ``(nullopt, nullopt)``), which would pin a
held shared prefix with no expiry, so the demote plan carries the normal plan's ranges there.

The same rule without a ledger (:func:`demote_start`): given the deleted prompt's hashes and
the prompts of the other live stored responses that may share it (a gateway reads them from
the response store, so a restarted gateway, or another one sharing the registry, demotes the
same blocks), the range starts past the longest prefix any of them shares. With chained
hashes "another prompt holds block i" is "it agrees on the first i + 1 hashes", so this is
the ledger's first block with count 0. The caller may also protect a leading segment it
cannot see the other holders of (the gateway: the system segment, which every conversation
with the same instructions and tools shares, stored or not).

A delete also orphans the deleted response's *descendants*: a continuation rebuilds its
prompt from the whole stored chain, so once a link is gone no descendant can be continued
(the store answers "not found", as OpenAI's does) and the blocks they hold are dead too.
:func:`orphaned` names them from the conversation's parent links; the caller demotes the
orphaned leaves' prompts (each covers its ancestors' blocks), held only by what the rows
outside the orphaned subtree hold. :func:`doomed` is that rule over the conversation's rows,
the one the gateway (``server/gateway/api/conversation_demote.py``) and the simulator
(``retention/simulation/conversational.py``, ``+conv+demote``) both apply; a leaf whose chain
is already broken (:func:`continuable` false) cannot be rebuilt, so nothing is sent for it.
Deleting a chain oldest first then demotes it at once,
where counting descendants as holders (the ledger) would never demote it: the last delete
could no longer rebuild its prompt from the broken chain.

Pure: no clock, no I/O. Memory per tenant: at most ``MAX_TRACKED`` responses (the oldest
are forgotten, their counts dropped).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from retention.types import DEFAULT_PRIORITY, MIN_PRIORITY, RetentionPlan, TokenRange

MAX_TRACKED = 65_536  # stored responses tracked per tenant
MAX_LEAVES = 8  # orphaned leaves demoted per delete (the newest): one engine request each
DEMOTE_PRIORITY = MIN_PRIORITY  # 0: the first free queue ``getFreeBlock`` takes from


def demote_priority(secondary_blocks: int, offload_min_priority: int) -> int:
    """The priority a demote gives a pool's blocks: first to leave the GPU, and to host if it can.

    ``LRUEvictionPolicy::getFreeBlock`` (``evictionPolicy.cpp``) takes the head of the lowest
    non-empty priority queue and offloads the victim to a free host block iff its priority is
    at or above ``mSecondaryOffloadMinPriority``; below it the block is dropped. Without a host
    tier that makes no difference, and 0 puts the demoted blocks before every other one. With a
    host tier, 0 drops them, and a run that comes back after all (one that waited for a human,
    or a deleted branch's shared history) recomputes what the host tier would have kept (``bench/retention/conversation.py``, seed 0,
    agent-loop at 2 % GPU + 4x host: adaptive with the run's-end demote 85.61 % at 0 against
    adaptive's 87.74 % without it; 87.74 % at the threshold, 30 by default). So a
    pool with a host tier demotes to its threshold when that is still below the default 35
    (evicted before every unheld block, but offloaded); a threshold at or above 35 would lift
    the blocks over unheld ones, so those pools demote to 0.
    """
    if secondary_blocks > 0 and offload_min_priority < DEFAULT_PRIORITY:
        return offload_min_priority
    return DEMOTE_PRIORITY


@dataclass(slots=True)
class _TenantBlocks:
    responses: dict[str, tuple[int, ...]] = field(default_factory=dict)  # insertion order = oldest first
    counts: dict[int, int] = field(default_factory=dict)  # block hash -> live responses holding it

    def drop(self, hashes: tuple[int, ...]) -> None:
        counts = self.counts
        for h in hashes:
            left = counts[h] - 1
            if left:
                counts[h] = left
            else:
                del counts[h]


@dataclass(slots=True)
class DemoteLedger:
    """Per tenant: the prompt blocks of every live stored response, counted per block."""

    _tenants: dict[str, _TenantBlocks] = field(default_factory=dict)

    def stored(self, tenant: str, response_id: str, hashes: Sequence[int]) -> None:
        """A stored response's prompt (its full blocks' hashes, root first) is live."""
        state = self._tenants.setdefault(tenant, _TenantBlocks())
        old = state.responses.pop(response_id, None)
        if old is not None:
            state.drop(old)
        kept = tuple(hashes)
        state.responses[response_id] = kept
        for h in kept:
            state.counts[h] = state.counts.get(h, 0) + 1
        if len(state.responses) > MAX_TRACKED:
            oldest = next(iter(state.responses))
            state.drop(state.responses.pop(oldest))

    def delete(self, tenant: str, response_id: str) -> int | None:
        """The response is deleted: the index of its first block no live response holds.

        ``None`` when the ledger does not know it or every block is still held elsewhere
        (nothing to demote); otherwise a block index below ``len(hashes)``.
        """
        state = self._tenants.get(tenant)
        hashes = None if state is None else state.responses.pop(response_id, None)
        if hashes is None:
            return None
        state.drop(hashes)
        counts = state.counts
        for index, h in enumerate(hashes):
            if h not in counts:
                return index
        return None

    def chain_start(self, tenant: str, response_id: str, chain: Collection[str]) -> int | None:
        """The index of ``response_id``'s first prompt block that no live stored response *outside*
        ``chain`` (its own conversation's responses) holds; the response stays live.

        For a run that ended (its last answer a message, not a tool call): its whole own
        history is dead, though its earlier responses are still stored. ``None``: unknown, or
        every block shared with another conversation. Cost: blocks × chain length.
        """
        state = self._tenants.get(tenant)
        hashes = None if state is None else state.responses.get(response_id)
        if hashes is None:
            return None
        members = [m for m in (state.responses.get(r) for r in set(chain) | {response_id}) if m is not None]
        for index, h in enumerate(hashes):
            inside = sum(1 for m in members if len(m) > index and m[index] == h)
            if state.counts.get(h, 0) <= inside:
                return index
        return None

    def live(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return 0 if state is None else len(state.responses)


def orphaned(parents: Mapping[str, str | None], deleted: str) -> tuple[set[str], list[str]]:
    """The responses a delete leaves without a continuable chain, and the leaves among them.

    ``parents`` maps each live response of the conversation to its ``previous_response_id``
    (insertion order kept for the leaves). Returns ``deleted`` and every response whose chain
    of parents reaches it, and those of them no other of them continues (in ``parents``'
    order; ``[deleted]`` when it has no live descendant). A response whose chain leaves the
    conversation's live rows without reaching ``deleted`` is not orphaned by this delete.
    """
    dead: dict[str, bool] = {deleted: True}

    def reaches(rid: str) -> bool:
        path = []
        current: str | None = rid
        while current is not None and current not in dead:
            path.append(current)
            current = parents.get(current)
            if current in path:  # a cycle cannot be stored; never loop on one
                current = None
        verdict = current is not None and dead[current]
        for r in path:
            dead[r] = verdict
        return verdict

    subtree = {rid for rid in parents if reaches(rid)} | {deleted}
    parented = {parents.get(rid) for rid in subtree}
    leaves = [rid for rid in parents if rid in subtree and rid not in parented]
    if deleted not in parents and deleted not in parented:
        leaves.append(deleted)
    return subtree, leaves


def continuable(parents: Mapping[str, str | None], response_id: str) -> bool:
    """Whether ``response_id``'s prompt can be rebuilt from the rows: its chain of parents reaches a
    first response (no ``previous_response_id``) through ``parents`` alone. A continuation (and a
    demote, which rebuilds the prompt the same way) reads the whole chain; one missing link and
    the store answers "not found"."""
    seen: set[str] = set()
    current: str | None = response_id
    while current is not None:
        if current in seen or current not in parents:
            return False
        seen.add(current)
        current = parents[current]
    return True


@dataclass(frozen=True, slots=True)
class Doomed:
    """What a delete leaves dead in its conversation (:func:`doomed`).

    ``leaves``: the orphaned leaves to demote (the newest ``max_leaves``, oldest first), each
    prompt covering its orphaned ancestors' blocks. ``live``: the prompts of the conversation's
    rows outside the orphaned subtree whose blocks are known; ``unknown``: some such row's
    blocks are not known, so it may hold any block and nothing can be demoted.
    """

    leaves: tuple[str, ...]
    live: tuple[tuple[int, ...], ...]
    unknown: bool = False

    def start(self, hashes: Sequence[int], *, protected_blocks: int = 0) -> int | None:
        """:func:`demote_start` of one leaf's prompt against the live rows (None: nothing to demote)."""
        held = (*self.live, tuple(hashes)) if self.unknown else self.live
        return demote_start(hashes, held, protected_blocks=protected_blocks)


def doomed(rows: Iterable[tuple[str, str | None, Sequence[int] | None]], deleted: str, *,
           max_leaves: int = MAX_LEAVES) -> Doomed:
    """The delete rule the gateway and the simulator share: ``rows`` are the conversation's live
    stored responses, oldest first, as ``(id, previous_response_id, prompt block hashes or None)``,
    the deleted one included (read before the delete). The demoted prompts are :func:`orphaned`'s
    leaves (the newest ``max_leaves``); what still holds blocks is every row outside the orphaned
    subtree. Other conversations are not rows here: the caller protects the segment they can share
    (the system and tools segment) with ``protected_blocks``.
    """
    listed = list(rows)
    dead, leaves = orphaned({rid: prev for rid, prev, _ in listed}, deleted)
    held = [blocks for rid, _, blocks in listed if rid not in dead]
    live = tuple(tuple(b) for b in held if b is not None)
    return Doomed(tuple(leaves[-max_leaves:] if max_leaves > 0 else ()), live, len(live) < len(held))


def shared_blocks(prompt: Sequence[int], other: Sequence[int]) -> int:
    """How many leading blocks two prompts share (chained hashes: equal at ``i`` means equal up to ``i``)."""
    n = 0
    for a, b in zip(prompt, other):
        if a != b:
            break
        n += 1
    return n


def demote_start(deleted: Sequence[int], live: Iterable[Sequence[int]], *, protected_blocks: int = 0) -> int | None:
    """The index of ``deleted``'s first block that no prompt of ``live`` holds, at or past
    ``protected_blocks``; None when there is none (everything is still held or protected).

    Invariant: every block before the returned index is held by some live prompt or
    protected, and the returned block and all after it are held by none (chained hashes).
    """
    if protected_blocks < 0:
        raise ValueError("protected_blocks must be >= 0")
    start = protected_blocks
    for other in live:
        start = max(start, shared_blocks(deleted, other))
        if start >= len(deleted):
            return None
    return start if start < len(deleted) else None


def end_start(prompt: Sequence[int], rows: Iterable[tuple[str, Sequence[int] | None]], root: str, *,
              protected_blocks: int = 0) -> int | None:
    """After a run ended (its last answer a message, not a tool call; it stays stored): the index of
    ``prompt``'s first block that no stored prompt of *another* conversation holds, at or past
    ``protected_blocks``; None when there is none.

    ``rows`` are ``(root id, prompt block hashes)`` of live stored responses of the tenant; those of
    ``root`` (the run's own conversation, ``prompt``'s earlier steps and forks) do not protect
    anything: the run is over, its whole history is dead though still stored. A row of another
    conversation whose blocks are unknown (``None``) is taken to share the protected segment only,
    as the delete path takes every conversation it does not read. The gateway's counterpart of
    :meth:`DemoteLedger.chain_start` (the simulator's), from rows rather than counts.
    """
    return demote_start(prompt, (blocks for owner, blocks in rows if owner != root and blocks is not None),
                        protected_blocks=protected_blocks)


def demote_length(cached_blocks: int, start_token: int, tokens_per_block: int, prompt_tokens: int) -> int | None:
    """How much of the deleted prompt to send: its cached full blocks and one token more.

    ``None`` when no cached block lies past ``start_token`` (nothing of the conversation's own
    is cached, so a demote would only prefill it again, evicting others to hold it). Cutting
    the prompt to the cached prefix keeps the cost at one computed prompt token (plus the one
    generated): ``cached_blocks`` comes from what the caller sees of the cache (the pool's
    lookup in the simulator, the KV events' view in the gateway).
    """
    cached = min(cached_blocks * tokens_per_block, prompt_tokens - 1)
    if cached <= start_token:
        return None
    return cached + 1


def demote_plan(normal: RetentionPlan, start_token: int, priority: int = DEMOTE_PRIORITY) -> RetentionPlan:
    """``normal`` before ``start_token``, ``priority`` (0 unless the pool's :func:`demote_priority`
    says otherwise) with no expiry from there on (decode too).

    The normal plan's ranges are cut at ``start_token`` so the shared prefix is re-claimed
    exactly as an ordinary request of the tenant would claim it.
    """
    if start_token < 0:
        raise ValueError("start_token must be >= 0")
    head = []
    for rng in normal.ranges:
        if rng.start >= start_token:
            break
        end = start_token if rng.end is None else min(rng.end, start_token)
        head.append(TokenRange(rng.start, end, rng.priority, rng.duration_ms))
    return RetentionPlan((*head, TokenRange(start_token, None, priority, None)), priority, None)


__all__ = ["DEMOTE_PRIORITY", "MAX_LEAVES", "DemoteLedger", "Doomed", "continuable", "demote_length", "demote_plan",
           "demote_priority", "demote_start", "doomed", "end_start", "orphaned", "shared_blocks"]
