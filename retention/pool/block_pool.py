"""The KV block pool: TensorRT-LLM V1 KV-manager semantics, two tiers, one implementation.

The reference engine keeps its KV in this pool, and the simulator replays traces through
it. Sources (TensorRT-LLM release/1.2):

* ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``:
  ``WindowBlockManager::addSequence`` (the last prompt token is never matched),
  ``loadOrAllocateBlocks`` (match full blocks, priority override on reuse, onboarding),
  ``getFreeBlock`` (offload iff the victim holds tokens, its priority is at or above the
  threshold and a host block is free; otherwise the victim's descendants are dropped),
  ``onboardBlock``, ``storeBlocks`` / ``releaseBlocks`` (store full blocks for reuse,
  release in reverse order so a chain's leaf is the least recently released);
* ``cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp``: ``LRUEvictionPolicy``
  (``getFreeBlock``: head of the lowest non-empty priority, offload flag ``level >=
  mSecondaryOffloadMinPriority`` with default 30; ``releaseBlock``: a duration starts at
  release if the priority is not 35; ``claimBlock``: an explicit priority overrides,
  the duration is replaced; ``refresh``: expired blocks go back to priority 35);
* ``cpp/include/tensorrt_llm/executor/executor.h``: ``KvCacheRetentionConfig``
  (``getPerBlockRetentionPriorityDuration``: a block takes the range holding its first
  token; uncovered blocks get no priority, i.e. 35 when new and unchanged when reused).

Where kvgate deliberately differs (documented in docs/architecture.md, "Retention core"):
only free *leaves* of a tier are victims (TensorRT-LLM's queue may hand out a non-leaf and
then drop its subtree); content-free slots are used before any cached block; partial-block
reuse is not modelled; a chain is never stored below a host block.

Layout of one request (B = tokens_per_block)::

    tokens   |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- 3 (partial) ->|<- reserve ->|
    matched  | reused (GPU)| reused(host→GPU onboard)  |   new            |  new        |
    priority | plan range holding the block's first token                | decode      |

Split by concern (the way vLLM v1 keeps ``KVCacheManager`` apart from ``BlockPool``): this
module is the manager (prefix lookup, check-then-commit allocation, storing a finished
sequence's blocks in the radix tree); ``tiers.py`` owns the blocks, their free lists and
every move (claim, evict by drop or offload, onboard, release, expire); ``recorder.py``
the events, counters and per-tenant counts; ``invariants.py`` the whole-pool check.

Time: every mutating call takes ``now`` in seconds (any monotonic origin); durations are
milliseconds. Nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from struct import Struct

from retention.hashing import chain_hash, chain_hashes, pack_tokens, root_hash
from retention.pool.blocks import Block
from retention.pool.events import KvEvent, StoredBlock, StoredEvent, UpdatedEvent
from retention.pool.invariants import check_pool_invariants
from retention.pool.recorder import PoolRecorder
from retention.pool.stats import PoolStats
from retention.pool.tiers import Tiers
from retention.pool.types import Allocation, BlockCopy, PoolConfig, PoolError, per_block_retention
from retention.types import DEFAULT_PLAN, DEFAULT_PRIORITY, RetentionPlan, Tier

__all__ = ["BlockPool"]

P, S = Tier.PRIMARY, Tier.SECONDARY


@dataclass(slots=True)
class _Sequence:
    request_id: Hashable
    tenant: str | None
    salt_root: int
    extra_key: bytes
    plan: RetentionPlan
    prompt_len: int
    prompt_bytes: bytes
    hashes: list[int]  # hashes of the prompt's full blocks
    blocks: list[Block] = field(default_factory=list)
    orphans: list[Block] = field(default_factory=list)  # own copies replaced by stored twins


class BlockPool:
    """Two-tier KV block pool with priorities, durations, offload/onboard, events, stats.

    Invariants (``check_invariants``): each tier's blocks are EMPTY, CACHED or IN USE
    (see ``retention/pool/blocks.py``); the free lists hold exactly the EMPTY blocks and the
    CACHED tier-leaves; every tree block is reachable from the root through ``parent``;
    a host block is never referenced and has only host children; no call changes any
    state when it returns ``None``.
    """

    def __init__(self, config: PoolConfig) -> None:
        self._config = config
        self._bpt = config.tokens_per_block
        self._block_ints = Struct(f"<{config.tokens_per_block}i")
        self._rec = PoolRecorder(config)
        self._tiers = Tiers(config, self._rec)
        self._seqs: dict[Hashable, _Sequence] = {}

    # ------------------------------------------------------------------ queries
    @property
    def config(self) -> PoolConfig:
        return self._config

    def num_free_blocks(self, tier: Tier = P) -> int:
        """Blocks with no reference: for the host tier, every block (host blocks are never referenced)."""
        return self._tiers.num_free_primary if tier == P else self._config.secondary_blocks

    def lookup(self, tokens: Sequence[int], *, salt: str | None, extra_key: bytes = b"") -> tuple[int, int, int]:
        """(matched blocks, of which primary, of which secondary) that ``allocate`` would reuse now.

        Pure: no state change. Matching stops one token short of the prompt's end
        (``WindowBlockManager::addSequence``: "the last token can't be recovered").
        """
        packed = pack_tokens(tokens)
        path = self._match(packed, len(packed) // 4, self._hashes(packed, root_hash(salt), extra_key))
        primary = sum(1 for b in path if b.tier == P)
        return len(path), primary, len(path) - primary

    def can_allocate(
        self, tokens: Sequence[int], *, salt: str | None, reserve_tokens: int = 0, extra_key: bytes = b""
    ) -> bool:
        """Whether ``allocate`` would succeed now (ignoring expiries, which never change room)."""
        packed = pack_tokens(tokens)
        n = len(packed) // 4
        path = self._match(packed, n, self._hashes(packed, root_hash(salt), extra_key))
        return self._fits(path, self._num_blocks(n + reserve_tokens))

    # ------------------------------------------------------------------ allocate
    def allocate(
        self,
        request_id: Hashable,
        tokens: Sequence[int],
        *,
        salt: str | None,
        tenant: str | None,
        plan: RetentionPlan = DEFAULT_PLAN,
        now: float,
        reserve_tokens: int = 0,
        extra_key: bytes = b"",
        hashes: Sequence[int] | None = None,
    ) -> Allocation | None:
        """Give ``request_id`` blocks for ``tokens`` (+ ``reserve_tokens``), reusing its cached prefix.

        Check-then-commit: returns ``None`` with no state change when the blocks do not
        fit. Otherwise: matched primary blocks are claimed, matched host blocks onboarded,
        the rest allocated (each allocation may offload or drop a victim). A reused block
        takes the plan's priority/duration if a range covers its first token (else keeps its
        priority); new prompt blocks take the covering range or 35; blocks past the prompt
        take the decode priority/duration.

        ``hashes``: the chained hashes of the full blocks of ``tokens`` under ``salt`` and
        ``extra_key`` (``retention.hashing.block_hashes``), for a caller that has them (the
        simulator, which retries a waiting request many times): the pool then hashes nothing.
        They are trusted as hashes only; a hash hit is still confirmed by the block's parent and
        tokens, exactly as when the pool hashes itself.
        """
        if request_id in self._seqs:
            raise PoolError(f"request {request_id!r} already holds blocks")
        if reserve_tokens < 0:
            raise PoolError("reserve_tokens must be >= 0")
        packed = pack_tokens(tokens)
        n = len(packed) // 4
        if n == 0:
            raise PoolError("tokens must not be empty")
        salt_root = root_hash(salt)
        if hashes is None:
            hashes = self._hashes(packed, salt_root, extra_key)
        elif len(hashes) != n // self._bpt:
            raise PoolError(f"{len(hashes)} hashes given for {n // self._bpt} full blocks")
        else:
            hashes = list(hashes)  # the sequence keeps them: a copy the caller cannot change
        path = self._match(packed, n, hashes)
        total = self._num_blocks(n + reserve_tokens)
        if not self._fits(path, total):
            return None
        tiers = self._tiers
        tiers.refresh(now)
        bpt = self._bpt
        seq = _Sequence(request_id, tenant, salt_root, extra_key, plan, n, packed, hashes)
        copies: list[BlockCopy] = []
        counters = self._rec.counters
        per_block = per_block_retention(plan, self._num_blocks(n), bpt)
        # Claim the whole matched path first so no victim search can pick a block of it; the events
        # still come block by block as ``loadOrAllocateBlocks`` emits them: the block's priority
        # update, then its onboarding (the victim's offload/removal, then its host -> GPU update).
        old_priorities = [tiers.claim_reused(block, per_block[index]) for index, block in enumerate(path)]
        onboarded = 0
        emit = self._rec.emit
        for block, old in zip(path, old_priorities):
            if old is not None:
                emit(lambda i, b=block, o=old: UpdatedEvent(
                    i, b.block_hash, priority=(o, b.priority)))  # type: ignore[arg-type]
            if block.tier == S:
                tiers.onboard(block, copies)
                onboarded += 1
            seq.blocks.append(block)
        counters.reused_blocks += len(path)
        counters.reused_secondary_blocks += onboarded
        counters.reused_primary_blocks += len(path) - onboarded
        counters.missed_blocks += self._num_blocks(n) - len(path)
        take, count = tiers.take_primary, self._rec.count
        blocks = seq.blocks
        # ``loadOrAllocateBlocks`` gives a new block a key when it holds some of the prompt's first
        # n - 1 tokens (``chopVectorIntoBlocks(..., inputLength - 1, ..., true)``, partial included).
        num_keyed = self._num_blocks(n - 1)
        for index in range(len(path), total):
            if index * bpt >= n:
                priority, duration = plan.decode_priority, plan.decode_duration_ms
            else:
                rng = per_block[index]
                priority, duration = (DEFAULT_PRIORITY, None) if rng is None else rng
            block = take(copies)  # inlined ``Tiers.take_new``
            block.priority = priority
            block.duration_ms = duration
            block.ref_count = 1
            if index < num_keyed:
                block.keyed = True
            if tenant is not None:
                block.tenant = tenant
                count(block, P, +1)
            blocks.append(block)
        self._seqs[request_id] = seq
        return Allocation(
            request_id=request_id,
            slots=tuple(b.slot for b in seq.blocks),
            num_cached_tokens=len(path) * bpt,
            reused_blocks=len(path),
            onboarded_blocks=onboarded,
            new_blocks=total - len(path),
            copies=tuple(copies),
        )

    def extend(self, request_id: Hashable, num_tokens: int, *, now: float) -> tuple[tuple[int, ...], tuple[BlockCopy, ...]] | None:
        """Grow the sequence's capacity to ``num_tokens`` tokens; new blocks take the decode retention.

        Returns (all slots, copies to run first), or ``None`` with no state change when
        there is no room.
        """
        seq = self._seq(request_id)
        tiers = self._tiers
        needed = self._num_blocks(num_tokens) - len(seq.blocks)
        if needed > 0:
            if needed > tiers.num_free_primary:
                return None
            tiers.refresh(now)
        copies: list[BlockCopy] = []
        for _ in range(max(needed, 0)):
            seq.blocks.append(tiers.take_new(seq.plan.decode_priority, seq.plan.decode_duration_ms, seq.tenant, copies))
        return tuple(b.slot for b in seq.blocks), tuple(copies)

    # ------------------------------------------------------------------ store while running
    def store(self, request_id: Hashable, tokens: Sequence[int], *, num_computed_tokens: int) -> None:
        """Store a running sequence's full blocks of the first ``num_computed_tokens`` tokens for reuse now.

        TensorRT-LLM does not wait for a request to end: when its context phase is done it stores
        the full blocks of ``tokens[:promptLen - 1]`` (``BlockManager::storeContextBlocks``), and
        while it generates, each step whose ``len(tokens) - 1`` is a whole number of blocks (one or
        more: with ``blockKeys.size() < 2`` it stores all) stores them
        (``WindowBlockManager::storeNewBlock``), both called from
        ``trtGptModelInflightBatching.cpp`` ``forwardAsync``; a request arriving meanwhile reuses
        them. Same walk as :meth:`release` (``storeBlocks``: blocks already stored are skipped), the
        sequence keeps its references; a twin stored meanwhile by another sequence is adopted as at
        release, the sequence's own copy held until it ends.
        """
        seq = self._seq(request_id)
        packed = pack_tokens(tokens)
        if not packed.startswith(seq.prompt_bytes):  # compared in place: prompts are long
            raise PoolError(f"stored tokens of {request_id!r} do not start with its prompt")
        computed = max(0, min(num_computed_tokens, len(packed) // 4, len(seq.blocks) * self._bpt))
        if self._config.enable_block_reuse:
            self._store(seq, packed, computed // self._bpt)

    # ------------------------------------------------------------------ release
    def release(
        self, request_id: Hashable, tokens: Sequence[int], *, now: float, num_computed_tokens: int | None = None
    ) -> None:
        """Store the sequence's full blocks for reuse and drop its references (also for cancellation).

        ``tokens`` is the whole sequence (prompt + generated) and must start with the
        prompt. Only the first ``num_computed_tokens`` tokens have valid KV; the default
        is ``len(tokens) - 1``, TensorRT-LLM's assumption (``releaseBlocks``: the last
        sampled token was never fed back). Every full block inside that span is stored
        (``storeBlocks``: walk from the root, reuse matching nodes, insert the rest);
        other blocks become empty. Blocks are released leaf-first; a block with a
        duration and a priority other than 35 expires at ``now + duration``.
        """
        seq = self._seq(request_id)
        packed = pack_tokens(tokens)
        n = len(packed) // 4
        if not packed.startswith(seq.prompt_bytes):
            raise PoolError(f"release tokens of {request_id!r} do not start with its prompt")
        computed = n - 1 if num_computed_tokens is None else num_computed_tokens
        computed = max(0, min(computed, n, len(seq.blocks) * self._bpt))
        del self._seqs[request_id]
        tiers = self._tiers
        tiers.refresh(now)
        if self._config.enable_block_reuse:
            self._store(seq, packed, computed // self._bpt)
        tiers.release_refs(seq.blocks, now)
        tiers.release_refs(seq.orphans, now)

    # ------------------------------------------------------------------ events, stats
    def take_events(self) -> list[KvEvent]:
        """Drain and return the queued events, oldest first."""
        return self._rec.take_events()

    def stats(self) -> PoolStats:
        """A snapshot: ``KvCacheStats`` fields, tier occupancy, cumulative traffic counters.

        Invariant: ``used_num_blocks + free_num_blocks == max_num_blocks``.
        """
        tiers = self._tiers
        return self._rec.stats(
            self._config,
            num_free_primary=tiers.num_free_primary,
            host_empty=tiers.free[S].empty.size,
            num_cached=len(tiers.cached),
        )

    def tenant_blocks(self) -> dict[str, tuple[int, int]]:
        """tenant -> (primary, secondary) blocks it holds, in use or cached (owner = who allocated it)."""
        return self._rec.tenant_blocks()

    def active_requests(self) -> int:
        """Requests holding blocks (allocated and not yet released)."""
        return len(self._seqs)

    # ------------------------------------------------------------------ internals: matching
    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self._bpt)

    def _hashes(self, packed: bytes, salt_root: int, extra_key: bytes) -> list[int]:
        """The chained hashes of every full block of ``packed`` below ``salt_root``."""
        return chain_hashes(packed, self._bpt, salt_root, extra_key)

    def _match(self, packed: bytes, n: int, hashes: Sequence[int]) -> list[Block]:
        """Longest cached chain of full blocks (at most ``(n-1)//B``) whose hashes are ``hashes``.

        A hash hit counts only if the tree block hangs below the previous one of the chain
        and holds the same tokens, so a colliding (or wrongly given) hash never matches.
        """
        bpt = self._bpt
        width = bpt * 4
        limit = (n - 1) // bpt if self._config.enable_block_reuse else 0  # hashes: one per full block
        cached = self._tiers.cached
        path: list[Block] = []
        parent: Block | None = None
        for i in range(limit):
            block = cached.get(hashes[i])
            if block is None or block.parent is not parent or block.tokens != packed[i * width : (i + 1) * width]:
                break
            path.append(block)
            parent = block
        return path

    def _fits(self, path: list[Block], total: int) -> bool:
        onboard = free_on_path = 0  # host blocks to onboard; free GPU blocks the path itself claims
        for block in path:
            if block.tier == S:
                onboard += 1
            elif block.ref_count == 0:
                free_on_path += 1
        return onboard + total - len(path) <= self._tiers.num_free_primary - free_on_path

    def _seq(self, request_id: Hashable) -> _Sequence:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise PoolError(f"unknown request {request_id!r}") from None

    # ------------------------------------------------------------------ internals: storing
    def _store(self, seq: _Sequence, packed: bytes, num_full: int) -> None:
        """``WindowBlockManager::storeBlocks``: insert the sequence's unstored full blocks."""
        width = self._bpt * 4
        parent: Block | None = None
        stored: list[Block] = []
        hashes = seq.hashes
        cached = self._tiers.cached
        h = seq.salt_root
        for i in range(num_full):
            chunk = None if i < len(hashes) else packed[i * width : (i + 1) * width]
            h = hashes[i] if chunk is None else chain_hash(h, chunk, seq.extra_key)
            block = seq.blocks[i]
            existing = cached.get(h)
            if existing is block:  # stored already (a sequence stores at its prefill's end and again at release)
                parent = block
                continue
            if chunk is None:  # sliced only past the blocks already stored
                chunk = packed[i * width : (i + 1) * width]
            if existing is not None:
                if existing.parent is not parent or existing.tokens != chunk or existing.tier == S:
                    break  # hash collision, or a host twin: stop (never hang GPU blocks below host)
                # A twin with the same KV was stored meanwhile: the sequence adopts it (takes a
                # reference, so reference counts stay monotone along chains) and frees its own copy.
                self._tiers.adopt(existing)
                seq.orphans.append(block)
                seq.blocks[i] = existing
                parent = existing
                continue
            if block.block_hash is not None:
                break  # cannot happen for a consistent caller; never re-parent a tree node
            block.block_hash = h
            block.keyed = True
            block.tokens = chunk
            block.parent = parent
            if parent is not None:  # referenced by this sequence, so in no free list
                if parent.children is None:
                    parent.children = {}
                parent.children[h] = block
                parent.num_primary_children += 1
            cached[h] = block
            stored.append(block)
            parent = block
        if stored:
            first_parent = stored[0].parent
            block_ints = self._block_ints.unpack  # a block's int32 tokens as a tuple of ints
            self._rec.emit(
                lambda i: StoredEvent(
                    i,
                    None if first_parent is None else first_parent.block_hash,
                    tuple(
                        StoredBlock(b.block_hash, block_ints(b.tokens), P, b.priority)  # type: ignore[arg-type]
                        for b in stored
                    ),
                )
            )

    # ------------------------------------------------------------------ test support
    def peek_victim(self, tier: Tier = P) -> Block | None:
        """The block the next allocation in ``tier`` would take (tests, simulator)."""
        return self._tiers.free[tier].peek_victim()

    def all_blocks(self) -> list[Block]:
        """Every block object of both tiers (tests)."""
        return self._tiers.blocks[0] + self._tiers.blocks[1]

    def free_order(self, tier: Tier = P) -> list[Block]:
        """Free blocks of ``tier`` in the order they would be taken if nothing changed (tests)."""
        return self._tiers.free[tier].victim_order()

    def cached_blocks(self) -> dict[int, Block]:
        """Read-only view for tests: block hash -> tree block."""
        return self._tiers.cached

    def check_invariants(self) -> None:
        """O(pool size) consistency check used by the property tests (``retention/pool/invariants.py``)."""
        check_pool_invariants(self._tiers, self._config)
