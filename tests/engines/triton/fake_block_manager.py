"""The double's KV block manager: when TensorRT-LLM 1.2 stores blocks for reuse and which events say so.

Only for tests (``fake_trtllm.Executor`` drives it). Every rule cites the C++ it follows:
``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` (NVIDIA/TensorRT-LLM b35ac1b6, a 1.2-era
snapshot; the ``v1.2.1`` tag itself was not readable here), ``batch_manager/kvCacheEventManager.cpp``
(05843b0a), ``batch_manager/trtGptModelInflightBatching.cpp`` (forwardAsync / forwardSync),
``batch_manager/allocateKvCache.cpp`` (d2b9c97c). One attention window, beam width 1, no chunked context, no
sliding window, no draft tokens.

When blocks enter the reuse tree (each a ``WindowBlockManager::storeBlocks`` call, which walks
the chain from the root, skips blocks whose key is already in the tree and stores the rest)::

    iteration k  (request scheduled)   addSequence: match the prompt's blocks      no event
                 forwardAsync          generating    → addToken: one KV slot for the token fed
                                                       this step (a block when the slots
                                                       before it are a multiple of B)
                                       context done  → storeContextBlocks: full blocks of
                                                       tokens[:promptLen-1]         stored
                                       generating    → storeNewBlock: all blocks of
                                                       tokens[:n-1] when (n-1) % B == 0  stored
                 forwardSync           token appended; finished → releaseBlocks:
                                                       blocks of tokens[:n-1], the last
                                                       one partial too               stored
                 end of iteration      flushIterationEvents: the iteration's events are
                                       handed to the event manager's worker thread

so the block holding the last prompt token is stored only when generation fills it or at
release, never at enqueue. Partial reuse (``enable_partial_reuse``) is modelled as
``loadOrAllocateBlocks`` does it, including its silence: an unreferenced leaf that a prompt
matches only partly is taken out of the tree for the request *without a removed event*
(``silently_removed`` keeps them, for tests). Not modelled: capacity-driven eviction and
offload (tests call ``evict`` / ``offload`` / ``onboard`` on the executor), per-block retention
priorities (every stored block reports the default 35). ``add_sequence`` reports what
``KvCacheMetrics`` is made of (``Admission``): a matched block still in host memory is onboarded
(``onboardBlock``: ``getFreeBlock`` + a secondary→primary updated event), a partly matched block that is
referenced or has children is copied into a fresh one (``getFreeBlock``). ``add_token`` says when a
generation block is taken (``KVCacheManager::addToken`` → ``adjustBlocksIfNeeded`` → ``allocateBlock`` →
``getFreeBlock``); it counts KV slots (``GenerationRequest::getNumTokens``), which trail the request's tokens
(``append_token``, what the stores chop) by one once generation starts: the token a step generates gets its
slot at the next step, the one that ends the request never. A sampled end id is neither (it ends the request
without joining its tokens: ``fake_trtllm_plan``), so after it slots and tokens are equal.
``blocks_in_use`` gives ``KvCacheStats`` its used count: a store that finds a block already in the tree
takes no reference on it (``storeBlocks`` without ``pinBlocks``), so a request that computed the same
blocks as another keeps its own duplicates until it is released. ``find_new_context_block`` answers the
capacity scheduler, which delays a request whose first new block another starting request contributes
(``fake_trtllm_executor.Executor.step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
DEFAULT_PRIORITY = 35  # executor::KvCacheRetentionConfig::kDefaultRetentionPriority


def block_key_hash(tokens: list[int] | tuple[int, ...], parent_hash: int, salt_id: int | None) -> int:
    """``BlockKeyHasher::hash`` (kvCacheManager.cpp; later batch_manager/blockKey.cpp) for a key with
    no extra ids, no LoRA task and no multimodal keys; the salt only enters a root (``parentHash == 0``)."""
    seed = (len(tokens) ^ (parent_hash * 0xBF58476D1CE4E5B9)) & _M64

    def mix(value: int, seed: int) -> int:
        return (seed ^ ((value + (seed << 6) + (seed >> 2)) & _M64)) & _M64

    if parent_hash == 0 and salt_id is not None:
        c = ((salt_id ^ (salt_id >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        c = ((c ^ (c >> 27)) * 0x94D049BB133111EB) & _M64
        seed = mix((c ^ (c >> 31)) + 0x9E3779B9, seed)
    for token in tokens:
        a = int(token) & _M32  # static_cast<uint32_t>(tokenId)
        a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
        a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
        a = (a >> 16) ^ a
        seed = mix((a + 0x9E3779B9) & _M32, seed)  # uint32_t + unsigned int: wraps at 32 bits
    return seed


def chop(tokens: list[int], usable: int, tokens_per_block: int, allow_partial: bool) -> list[list[int]]:
    """``chopVectorIntoBlocks(vec, usableSize, elementsPerBlock, allowPartial)`` (include/.../batch_manager/
    kvCacheManager.h; in kvCacheManager.cpp's anonymous namespace in other snapshots): blocks of the first
    ``usable`` tokens, a short last one only with ``allow_partial``."""
    head = list(tokens[: max(usable, 0)])
    blocks = [head[i:i + tokens_per_block] for i in range(0, len(head), tokens_per_block)]
    if not allow_partial and blocks and len(blocks[-1]) < tokens_per_block:
        blocks.pop()
    return blocks


class Admission(NamedTuple):
    """One ``WindowBlockManager::loadOrAllocateBlocks`` (beam width 1): ``context`` prompt blocks
    (``numContextBlocks``), ``reused`` matched (``++mReusedBlocks``, partial matches included), of which
    ``onboarded`` came back from host memory (``onboardBlock`` → ``getFreeBlock``) and ``copied`` were a
    partly matched block copied into a fresh one (``getFreeBlock``, at most one: matching stops there).
    The misses are ``context - reused`` (``++mMissedBlocks``, each a ``getFreeBlock``)."""

    reused: int
    context: int
    onboarded: int = 0
    copied: int = 0

    @property
    def missed(self) -> int:
        return self.context - self.reused

    @property
    def free_blocks_taken(self) -> int:
        """``getFreeBlock`` calls (``++mAllocTotalBlocks``): the request's ``num_total_allocated_blocks``."""
        return self.missed + self.onboarded + self.copied


@dataclass(slots=True)
class TreeBlock:
    block_hash: int
    parent: int  # 0 = mCachedBlocksRoot (kCachedBlocksRootId, hash 0)
    tokens: tuple[int, ...]
    salt_id: int | None
    level: int = 0
    refs: int = 0
    children: dict[tuple[tuple[int, ...], int | None], int] = field(default_factory=dict)


@dataclass(slots=True)
class Sequence:
    """``GenerationRequest`` + the request's unique tokens (beam 0).

    ``tokens`` are the ``LlmRequest``'s (prompt + every generated token appended by forwardSync), what the stores
    chop; ``slots`` is ``GenerationRequest::getNumTokens``: the prompt length at ``addSequence``, + 1 per ``addToken``,
    the KV slots the sequence's blocks hold (``ceil(slots / B)`` blocks)."""

    request_id: int
    tokens: list[int]
    salt_id: int | None
    slots: int = 0
    # tree blocks that are this sequence's own (matched at addSequence, or its block that a store inserted); its
    # other blocks are private, a duplicate of a tree block included (storeBlocks takes no reference on a match)
    held: list[int] = field(default_factory=list)


class FakeBlockManager:
    """Reuse tree keyed by TensorRT-LLM's block hash; ``enqueue`` receives event data in order."""

    def __init__(self, tokens_per_block: int, *, enable_block_reuse: bool,
                 enqueue_stored: Callable[[Any, list[TreeBlock]], None],
                 enqueue_removed: Callable[[int], None],
                 enable_partial_reuse: bool = True, copy_on_partial_reuse: bool = True,
                 enqueue_onboarded: Callable[[int], None] | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.silently_removed: set[int] = set()  # left the tree through partial reuse, no event
        self.tree: dict[int, TreeBlock] = {}
        self.roots: dict[tuple[tuple[int, ...], int | None], int] = {}  # mCachedBlocksRoot's next blocks
        self.sequences: dict[int, Sequence] = {}
        self._enqueue_stored = enqueue_stored
        self._enqueue_removed = enqueue_removed
        self._enqueue_onboarded = enqueue_onboarded

    # kvCacheManager.cpp KVCacheManager::addSequence -> WindowBlockManager::addSequence / loadOrAllocateBlocks
    def add_sequence(self, request_id: int, prompt: list[int], salt_id: int | None) -> Admission:
        """The request's :class:`Admission`. Matching keys: ``chopVectorIntoBlocks(tokens,
        inputLength - 1, B, allowPartial=true)`` ("Ignore last token because it can't be recovered");
        a match walks ``findMatchingBlock`` from the root and stops at the first miss."""
        tpb = self.tokens_per_block
        seq = self.sequences[request_id] = Sequence(request_id, list(prompt), salt_id, len(prompt))
        context_blocks = -(-len(prompt) // tpb)  # tc::ceilDiv(inputLength, tokensPerBlock)
        if not self.enable_block_reuse:  # the second addSequence: allocate only, nothing matched or stored
            return Admission(0, context_blocks)
        reused = onboarded = copied = 0
        children = self.roots
        for key in chop(prompt, len(prompt) - 1, tpb, True)[:context_blocks]:
            found, partial = self._find_matching_block(children, tuple(key), salt_id)
            if found is None:
                break  # "searchRoot = nullptr; // no matching needed for following blocks"
            block = self.tree[found]
            reused += 1  # ++mReusedBlocks, partial matches included
            if not partial:  # "Recover block and reuse": claimBlock, then onboardBlock + addBlockToAllBeams
                onboarded += self._onboard(block)
                block.refs += 1
                seq.held.append(found)
                children = block.children
                continue
            if block.refs == 0 and not block.children:
                # "Leaf block that nobody is using. Make block private and reuse": freeLeafBlock unlinks it
                # from its parent and no event is enqueued, so event readers still count it as cached.
                # onboardBlock(matchingBlock) follows: a leaf still in host memory is onboarded.
                onboarded += self._onboard(block)
                self._unlink(block)
                del self.tree[found]
                self.silently_removed.add(found)
            else:
                # "copy reusable tokens": getFreeBlock + mTransferManager->onboard(matchingBlock, newBlock, ...);
                # onboardBlock(newBlock) then does nothing (newBlock is primary). The tree is untouched.
                copied += 1
            break  # "searchRoot = nullptr; // no matching needed for following blocks"
        return Admission(reused, context_blocks, onboarded, copied)

    def _onboard(self, block: TreeBlock) -> int:
        """``WindowBlockManager::onboardBlock``: a block in host memory (with ``onboardBlocks``, which the
        double always has) takes a ``getFreeBlock``, comes back to primary, and an updated event says so
        (``cacheLevelUpdated(kSecondaryLevel, kPrimaryLevel)``). 1 if it was onboarded."""
        if block.level == 0:
            return 0
        block.level = 0
        if self._enqueue_onboarded is not None:
            self._enqueue_onboarded(block.block_hash)
        return 1

    # kvCacheManager.cpp (b35ac1b6) WindowBlockManager::findNewContextBlock, which the capacity scheduler calls
    # (capacityScheduler.cpp beneficialToSkip -> oneManagerBeneficialToSkip) for a request not yet started
    def find_new_context_block(self, prompt: list[int], salt_id: int | None,
                               lora_id: int | None = None) -> tuple[tuple[int, ...], int | None] | None:
        """The ``BlockKey`` of the prompt's first full block not in the reuse tree, or None when every full
        block is there (or the prompt has none). Blocks: ``chopVectorIntoBlocks(uniqueTokens,
        uniqueTokens.size(), B, false)`` -- every full block, the last prompt token included. The walk uses
        ``findMatchingBlock(blockKey, false, false)`` (exact keys, the request's salt). The key returned,
        ``ret``, holds every token up to the end of that first new block (``ret.uniqueTokens`` accumulates
        each block's tokens) and the request's LoRA task, but no ``cacheSaltID``: two requests with the same
        tokens and different salts return equal keys. As ``(tokens, lora_id)``; the double's requests carry no
        LoRA task (kvgate sends none)."""
        tpb = self.tokens_per_block
        children = self.roots
        for i, key in enumerate(chop(prompt, len(prompt), tpb, False)):
            found = children.get((tuple(key), salt_id))
            if found is None:
                return tuple(int(t) for t in prompt[: (i + 1) * tpb]), lora_id
            children = self.tree[found].children
        return None

    # kvCacheManager.cpp KVCacheBlock::findMatchingBlock(blockKey, enablePartialReuse, copyOnPartialReuse)
    def _find_matching_block(self, children, tokens: tuple[int, ...], salt_id: int | None) -> tuple[int | None, bool]:
        """(block, partialMatch): an exact key returns ``!block->isFull()``; otherwise, with partial reuse,
        the child sharing the most leading tokens (same salt: BlockKey::partialMatch compares it first),
        among all children with copy-on-partial-reuse, else among unreferenced leaves."""
        if not tokens or not children:
            return None, False
        found = children.get((tokens, salt_id))
        if found is not None:
            return found, len(self.tree[found].tokens) != self.tokens_per_block
        if not self.enable_partial_reuse:
            return None, False
        best, best_hash = 0, None
        for (child_tokens, child_salt), child in children.items():
            block = self.tree[child]
            if child_salt != salt_id or not (self.copy_on_partial_reuse or (block.refs == 0 and not block.children)):
                continue
            matched = 0
            for a, b in zip(child_tokens, tokens):
                if a != b:
                    break
                matched += 1
            if matched > best:
                best, best_hash = matched, child
        return best_hash, best_hash is not None

    def _unlink(self, block: TreeBlock) -> None:
        parent = self.tree.get(block.parent)
        siblings = parent.children if parent is not None else self.roots
        siblings.pop((block.tokens, block.salt_id), None)

    # kvCacheManager.cpp BlockManager::storeContextBlocks: chopVectorIntoBlocks(uniqueTokens,
    # uniqueTokens.size() - 1, B, false); trtGptModelInflightBatching.cpp calls it in forwardAsync for a
    # request whose last context chunk ran, before forwardSync appends the first generated token.
    def store_context_blocks(self, request_id: int) -> None:
        seq = self.sequences[request_id]
        if self.enable_block_reuse:
            self._store_blocks(seq, chop(seq.tokens, len(seq.tokens) - 1, self.tokens_per_block, False))

    # kvCacheManager.cpp WindowBlockManager::storeNewBlock: usableSize = tokens - 1; nothing unless
    # usableSize % B == 0, then storeBlocks over every block (only the new last one is not yet in the tree);
    # trtGptModelInflightBatching.cpp forwardAsync calls it for every request in generation.
    def store_new_block(self, request_id: int) -> None:
        seq = self.sequences[request_id]
        usable = len(seq.tokens) - 1
        if self.enable_block_reuse and seq.tokens and usable % self.tokens_per_block == 0:
            self._store_blocks(seq, chop(seq.tokens, usable, self.tokens_per_block, True))

    # allocateKvCache.cpp (d2b9c97c) AllocateKvCache::operator(): for each generation request (never a context
    # one: it gets addSequence(promptLen)), getNumDraftTokens() + 1 addToken calls -- one here -- in forwardAsync
    # before the engine step (trtGptModelInflightBatching.cpp b35ac1b6). The slot is for the token the step feeds,
    # the one the previous step generated: a request of M sampled tokens runs M - 1 generation steps and ends
    # with promptLen + M - 1 slots; its last token (the one reaching max_tokens, or a sampled end id) is never fed,
    # so never gets one. A sampled end id is not appended either (append_token): the request's tokens are then
    # promptLen + M - 1 too, and releaseBlocks stores the first promptLen + M - 2 of them.
    def add_token(self, request_id: int) -> bool:
        """``KVCacheManager::addToken`` (kvCacheManager.cpp b35ac1b6): ``sequence.addNewTokens(1)``, then
        ``WindowBlockManager::adjustBlocksIfNeeded`` calls ``allocateBlock`` (one ``getFreeBlock``) when
        ``(getNumTokens() - 1) % tokensPerBlock == 0``. True when it took a new block."""
        seq = self.sequences[request_id]
        seq.slots += 1
        return (seq.slots - 1) % self.tokens_per_block == 0

    def append_token(self, request_id: int, token: int) -> None:
        """A generated token joins the request's tokens (forwardSync: updateRequests -> ``LlmRequest::addNewToken``);
        no KV slot and no block: that is ``add_token`` at the next step, if there is one. Never called for a sampled
        end id (updateRequests adds only the tokens the decoder's sequence length advanced by)."""
        self.sequences[request_id].tokens.append(int(token))

    # kvCacheManager.cpp KVCacheManager::removeSequence -> WindowBlockManager::releaseBlocks: with reuse,
    # storeBlocks over chopVectorIntoBlocks(uniqueTokens, size - 1, B, allowPartial=true) — the last,
    # partial block too — then every block's ref count drops.
    def release(self, request_id: int) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return  # cancelled before it was scheduled: it never had blocks
        if self.enable_block_reuse:
            self._store_blocks(seq, chop(seq.tokens, len(seq.tokens) - 1, self.tokens_per_block, True))
        for block_hash in seq.held:
            block = self.tree.get(block_hash)
            if block is not None:
                block.refs -= 1

    # kvCacheManager.cpp (b35ac1b6) WindowBlockManager::storeBlocks + kvCacheEventManager.cpp enqueueStoredEvent
    def _store_blocks(self, seq: Sequence, keys: list[list[int]]) -> None:
        """Walk from the root; a key already in the tree is traversed (no event), the first miss and every
        block after it are inserted with ``hash = BlockKeyHasher()(key, searchRoot->getHash())``. One stored
        event per call holding only the inserted blocks; its parent is the first inserted block's
        predecessor, None when that is ``mCachedBlocksRoot`` (block id < 0).

        What is inserted is the sequence's own block (``mAllBlocksById[blockIds[i]]``): it enters the tree and
        stays referenced by the sequence. On a match the C++ only moves on (``searchRoot = matchedBlock``) and
        takes a reference (``searchRoot->incRefCount()``) only with ``pinBlocks``, which storeContextBlocks,
        storeNewBlock and releaseBlocks never pass (it defaults to false; ``storeBlocksForReuse`` passes it): the
        sequence keeps its own duplicate block, counted as used and released by ``releaseBlocks`` from
        ``mAllocatedBlocksPerSeq``, and the matched tree block gains no reference."""
        parent_hash, children = 0, self.roots
        stored: list[TreeBlock] = []
        for key in keys:
            tokens = tuple(key)
            found = children.get((tokens, seq.salt_id))
            if found is None:
                found = block_key_hash(tokens, parent_hash, seq.salt_id)
                block = self.tree[found] = TreeBlock(found, parent_hash, tokens, seq.salt_id)
                children[(tokens, seq.salt_id)] = found
                stored.append(block)
                block.refs += 1  # the sequence's own block, now the tree's: its addBlockToBeam reference
                seq.held.append(found)
            parent_hash, children = found, self.tree[found].children
        if stored:
            self._enqueue_stored(stored[0].parent or None, stored)

    # kvCacheManager.cpp WindowBlockManager::freeChildren: descendants first, one removed entry each
    # (kvCacheEventManager.cpp enqueueRemovedEvent batches consecutive removals into one event).
    def evict(self, block_hash: int) -> None:
        block = self.tree[block_hash]
        if self._referenced(block):
            raise RuntimeError(f"block {block_hash} is in use: only unreferenced blocks are evicted")
        for child in list(block.children.values()):
            self.evict(child)
        self._unlink(block)
        del self.tree[block_hash]
        self._enqueue_removed(block_hash)

    def blocks_in_use(self) -> int:
        """Blocks held by running sequences: each tree block once however many sequences share it, plus each
        sequence's private blocks (``ceil(slots / B)`` in all -- ``addSequence``'s context blocks and ``add_token``'s
        generation blocks -- minus the tree blocks it holds). A released block
        is free even while the tree keeps it for reuse (evictionPolicy.cpp ``LRUEvictionPolicy::releaseBlock``
        counts it in ``mNumFreeBlocksPerLevel``; ``claimBlock`` takes it off again)."""
        shared: set[int] = set()
        private = 0
        for seq in self.sequences.values():
            held = [h for h in seq.held if h in self.tree]
            shared.update(held)
            private += max(0, -(-seq.slots // self.tokens_per_block) - len(held))
        return len(shared) + private

    def _referenced(self, block: TreeBlock) -> bool:
        return block.refs > 0 or any(self._referenced(self.tree[c]) for c in block.children.values())

    def evictable_roots(self) -> list[int]:
        return [h for h in self.roots.values() if not self._referenced(self.tree[h])]


class FakeEventQueue:
    """``KVCacheEventManager`` (batch_manager/kvCacheEventManager.cpp), the part a reader can observe.

    * ``enqueue*``: ``mEventQueue`` collects one iteration's events, each numbered from ``mEventId``
      (starts at 0, +1 per event); consecutive removals share one ``KVCacheRemovedData``
      (``enqueueRemovedEvent``: appended to the queue's last event when that is a removal).
    * ``flush``: ``flushIterationEvents`` at the end of every iteration (trtGptModelInflightBatching.cpp
      forwardSync) hands the queue to the worker thread (``flush`` → ``mPendingEvents``).
    * the worker (``worker``) appends each handed batch to ``mEvents`` asynchronously and drops the
      oldest events beyond ``mMaxSize`` (``event_buffer_max_size``), leaving a gap in the event ids.
      ``lag`` models its delay: a batch becomes visible only after ``lag`` reads that miss it, so a
      reader can see an iteration's responses before its events (late events).
    * ``take``: ``getEvents`` returns ``mEvents`` and empties it. ``wait=True`` is ``getEvents`` without a
      timeout (``mEmptyCV.wait``): the first batch still with the worker arrives whatever its lag, and with
      none there, nothing ever would: a RuntimeError says so rather than block the test for ever.
    """

    def __init__(self, max_size: int, make_event: Callable[[int, Any], Any], *, lag: int = 0) -> None:
        self.max_size = max_size
        self.lag = lag
        self._make_event = make_event
        self._next_id = 0
        self._queue: list[Any] = []
        self._handed: list[list[Any]] = []  # [countdown, events]
        self._events: list[Any] = []

    def enqueue(self, data: Any) -> None:
        self._queue.append(self._make_event(self._next_id, data))
        self._next_id += 1

    def enqueue_removed(self, block_hash: int, make_removed: Callable[[list[int]], Any]) -> None:
        last = self._queue[-1].data if self._queue else None
        if last is not None and hasattr(last, "block_hashes"):
            last.block_hashes.append(block_hash)
        else:
            self.enqueue(make_removed([block_hash]))

    def flush(self) -> None:
        if self._queue:
            self._handed.append([self.lag, self._queue])
        self._queue = []

    def take(self, *, wait: bool = False) -> list[Any]:
        if wait and not self._events and self._handed and self._handed[0][0] > 0:
            self._handed[0][0] = 0  # the worker delivers it and notifies mEmptyCV: the wait ends
        if wait and not self._events and not self._handed:
            raise RuntimeError("get_latest_events() without a timeout would block forever: no event is buffered "
                               "or on its way (kvCacheEventManager.cpp getEvents: mEmptyCV.wait until one "
                               "arrives); pass timeout_ms")
        while self._handed and self._handed[0][0] <= 0:  # FIFO: a batch never overtakes an earlier one
            self._events.extend(self._handed.pop(0)[1])
            if len(self._events) > self.max_size:  # "Events have been discarded."
                del self._events[: len(self._events) - self.max_size]
        for batch in self._handed:
            batch[0] -= 1
        out, self._events = self._events, []
        return out
