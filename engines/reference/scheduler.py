"""Continuous batching over the retention pool: who runs in the next step, and how much.

Every step mixes work under two limits, ``max_batch_size`` sequences and
``max_num_tokens`` computed tokens (TensorRT-LLM's ``maxBatchSize`` / ``maxNumTokens``)::

    step = [decode: 1 token for each running sequence whose prompt is done]
         + [prefill chunks: the rest of the token budget, oldest sequence first]
         + [admissions: waiting requests, FIFO, while the capacity policy lets them start]

Two capacity policies, TensorRT-LLM's ``executor::CapacitySchedulerPolicy``
(``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``):

* ``guaranteed_no_evict`` (the default, as in ``executor.h`` ``SchedulerConfig`` and the
  Triton backend's ``batch_scheduler_policy``): ``GuaranteedNoEvictScheduler`` starts a
  request only if the free blocks (cached reusable ones included, ``getNumFreeBlocks``),
  less every running request's blocks to completion, hold its own blocks to completion
  (``NoEvictScheduledBlocksManager``, ``KVCacheManager::getRemainingBlocksToCompletion``:
  ``ceil((prompt + max_new_tokens) / B)`` minus the blocks it holds; a cached prefix earns
  no credit). So a running request is never preempted.
* ``max_utilization`` (``MaxUtilizationScheduler``): a request starts when the pool can hold
  its prompt; when a decoding sequence cannot grow, the most recently admitted running
  sequence is preempted: its blocks are released (full blocks stay cached for reuse) and it
  re-enters the queue's head with its generated tokens, to be recomputed — mostly from cache.

Under both, a waiting request that cannot start stays queued (head of line, so a long
prompt is not starved by short ones: the C++ loop ``break``s at the first that does not fit).

Under both, with block reuse, a request not started yet is first passed to ``beneficialToSkip``
(``capacityScheduler.cpp`` at cf6abc45, ``GuaranteedNoEvictScheduler::impl`` and
``MaxUtilizationScheduler::operator()``, before the capacity checks): its new context block
(``WindowBlockManager::findNewContextBlock``, ``kvCacheManager.cpp`` at b35ac1b6: the full blocks of
all its tokens, the last token included, walked down the reuse tree with exact salted keys; the key holds
all tokens up to the end of the first full block not in the tree, and the LoRA task — none here — but
no cache salt; none when every full block is in the tree) is compared with the keys registered in this
pass (``newlyContributedContextBlocks``). Equal: the request is skipped (``continue``: it keeps its place
and the requests behind it may start) and starts at a later step, reusing the blocks the other one
stores at the end of its prefill. Otherwise it registers its key, whether it then fits or not. The
sequences still mid-prefill register theirs first (``prefillWithChunkedContextsAlreadyExecuting``):
their blocks are stored only with their last chunk (``storeContextBlocks``), so a twin of a prompt
prefilled in chunks waits until then. The key has no salt, so differently-salted identical prompts
delay each other a step too, and then share nothing. Keys are taken when a request's turn comes, after
this step's decode growth and the admissions before it; TensorRT-LLM takes them before the step allocates
anything (``addSequence`` follows scheduling), so a cached block evicted by such an allocation can
shorten a walk here (and change its key) where the C++ would still see it.

Invariants:
* a sequence in ``running`` holds a pool allocation whose capacity covers every token
  it has computed plus the ones scheduled in the current step;
* every allocation is released exactly once (finish, cancel or preemption), with the
  tokens whose KV is actually in the cache, so the pool stores only computed blocks; a
  running sequence's blocks are stored as TensorRT-LLM stores them, at the end of its prefill
  and at block boundaries while it decodes (:meth:`Scheduler.store_computed`), so a request
  admitted meanwhile reuses them;
* physical copies the pool asks for are handed to the caller before the step that
  needs them (``ScheduledStep.copies``), in the pool's order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from engines.contract import EngineRequest, KvMetrics, TokenLogProbs
from retention.pool import BlockCopy, BlockPool

GUARANTEED_NO_EVICT = "guaranteed_no_evict"
MAX_UTILIZATION = "max_utilization"
SCHEDULER_POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


class FinishReason(str, Enum):
    END_ID = "end_id"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's generation state. ``tokens`` = prompt + generated so far."""

    request_id: str
    request: EngineRequest
    tokens: list[int]
    prompt_len: int
    end_ids: frozenset[int]
    generator: torch.Generator | None = None
    generated: int = 0  # tokens generated (not counting the end token)
    num_computed: int = 0  # tokens whose KV is in the cache
    prefill_target: int = 0  # tokens to compute before sampling resumes (prompt, or prompt+generated after preemption)
    block_slots: list[int] = field(default_factory=list)
    admitted: bool = False
    metrics: KvMetrics = field(default_factory=KvMetrics)
    admit_seq: int = 0
    matcher: Any = None  # xgrammar GrammarMatcher of a guided request, advanced per accepted token
    log_probs: list[TokenLogProbs] = field(default_factory=list)  # per generated token, when asked

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target


@dataclass(slots=True)
class Work:
    seq: Sequence
    start: int  # first token position computed this step
    length: int  # tokens computed this step
    sample: bool  # a next token is sampled from the last position


@dataclass(slots=True)
class ScheduledStep:
    copies: list[BlockCopy]
    prefills: list[Work]
    decodes: list[Work]

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    """Queues and step planning; all pool mutations of the engine happen here."""

    def __init__(
        self, pool: BlockPool, *, tokens_per_block: int, max_batch_size: int, max_num_tokens: int,
        policy: str = GUARANTEED_NO_EVICT,
    ) -> None:
        if policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler policy must be one of {', '.join(SCHEDULER_POLICIES)}, got {policy!r}")
        self.pool = pool
        self.policy = policy
        self.tokens_per_block = tokens_per_block
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.prefill_target = len(seq.tokens)
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    # Planning -------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledStep:
        copies: list[BlockCopy] = []
        budget = self.max_num_tokens
        decodes: list[Work] = []
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq not in self.running:  # preempted while growing an earlier sequence
                continue
            if budget <= 0:
                break
            if not self._grow(seq, seq.num_computed + 1, now, copies):
                continue
            decodes.append(Work(seq, seq.num_computed, 1, True))
            budget -= 1
        # A later sequence's growth may have preempted one already planned.
        decodes = [w for w in decodes if w.seq in self.running]
        budget = self.max_num_tokens - len(decodes)
        prefills: list[Work] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.in_prefill:
                prefills.append(self._chunk(seq, budget))
                budget -= prefills[-1].length
        no_evict = self.policy == GUARANTEED_NO_EVICT
        available = 0
        if no_evict and self.waiting:
            available = self.pool.num_free_blocks() - sum(self.blocks_to_completion(s) for s in self.running)
        # beneficialToSkip is consulted only with block reuse; newlyContributedContextBlocks is built at the
        # first request looked at (the mid-prefill sequences' keys first).
        skip_for_reuse = self.pool.config.enable_block_reuse
        contributed: set[tuple[int, ...]] | None = None
        skipped: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
                seq = self.waiting[0]
                if skip_for_reuse:
                    if contributed is None:
                        contributed = self._contributed_by_prefills()
                    if self._beneficial_to_skip(seq, contributed):
                        skipped.append(self.waiting.popleft())  # "continue": it keeps its place (below)
                        continue
                if no_evict:
                    needed = self.blocks_to_completion(seq)
                    if needed > available:
                        break  # GuaranteedNoEvictScheduler: "If one requests fails to be scheduled, break"
                if not self._admit(seq, now, copies):
                    break  # queue, don't crash: retried after blocks are released
                if no_evict:
                    available -= needed
                self.waiting.popleft()
                self.running.append(seq)
                prefills.append(self._chunk(seq, budget))
                budget -= prefills[-1].length
        finally:
            self.waiting.extendleft(reversed(skipped))  # back at the head, in their order
        return ScheduledStep(copies, prefills, decodes)

    def _new_context_block(self, seq: Sequence) -> tuple[int, ...] | None:
        """``WindowBlockManager::findNewContextBlock``: the tokens up to the end of the first full block of
        ``seq.tokens`` that is not in the reuse tree (walked with the request's salt, both tiers), or None when
        every full block is there or there is none. The key has no salt (``ret`` takes the LoRA task only, and
        the reference engine has no LoRA)."""
        bpt = self.tokens_per_block
        full = len(seq.tokens) // bpt  # chopVectorIntoBlocks(uniqueTokens, uniqueTokens.size(), B, false)
        if full == 0:
            return None
        # ``lookup`` stops one token short of the end (addSequence's last-token rule); the walk here takes
        # every full block, so look up one token more: it lifts the limit to ``full`` and lies in no block walked.
        matched = self.pool.lookup([*seq.tokens, 0], salt=seq.request.cache_salt)[0]
        if matched >= full:
            return None
        return tuple(seq.tokens[: (matched + 1) * bpt])

    def _contributed_by_prefills(self) -> set[tuple[int, ...]]:
        """``prefillWithChunkedContextsAlreadyExecuting``: the new context blocks of the sequences mid-prefill
        (context phase, past their first chunk); theirs are stored only at the end of their prefill."""
        keys = (self._new_context_block(seq) for seq in self.running if seq.in_prefill)
        return {key for key in keys if key is not None}

    def _beneficial_to_skip(self, seq: Sequence, contributed: set[tuple[int, ...]]) -> bool:
        """``beneficialToSkip`` / ``oneManagerBeneficialToSkip`` for a request not started yet: True when its
        new context block is one an earlier request of this step registered; else it registers its own."""
        key = self._new_context_block(seq)
        if key is None:
            return False
        if key in contributed:
            return True  # "Better to skip this step so we can reuse."
        contributed.add(key)
        return False

    def blocks_to_completion(self, seq: Sequence) -> int:
        """``KVCacheManager::getRemainingBlocksToCompletion`` (beam width 1, no attention window):
        the blocks of prompt + ``max_new_tokens`` less the ones ``seq`` holds now."""
        total = -(-(seq.prompt_len + seq.request.max_new_tokens) // self.tokens_per_block)
        return total - len(seq.block_slots)

    def _chunk(self, seq: Sequence, budget: int) -> Work:
        length = min(seq.prefill_target - seq.num_computed, budget)
        done = seq.num_computed + length == seq.prefill_target
        return Work(seq, seq.num_computed, length, done)

    def _admit(self, seq: Sequence, now: float, copies: list[BlockCopy]) -> bool:
        request = seq.request
        allocation = self.pool.allocate(
            seq.request_id, seq.tokens, salt=request.cache_salt, tenant=request.tenant_id,
            plan=request.retention, now=now,
        )
        if allocation is None:
            return False
        copies.extend(allocation.copies)
        seq.block_slots = list(allocation.slots)
        # The pool never matches the last prompt token (its logits start generation).
        seq.num_computed = allocation.num_cached_tokens
        self._admissions += 1
        seq.admit_seq = self._admissions
        # TensorRT-LLM counts around ``KVCacheManager::addSequence`` and adds each admission's
        # counts (``LlmRequest::update*PerRequest``: ``+=``), so a re-admission after preemption
        # (max_utilization only) adds its own lookup. Total = blocks taken from the free pool
        # for the prompt (``getFreeBlock``): misses and onboards, never a reused GPU block.
        m = seq.metrics
        seq.metrics = KvMetrics(
            reused_blocks=m.reused_blocks + allocation.reused_blocks,
            new_blocks=m.new_blocks + allocation.new_blocks,
            total_blocks=m.total_blocks + allocation.new_blocks + allocation.onboarded_blocks,
            onboarded_blocks=m.onboarded_blocks + allocation.onboarded_blocks,
        )
        seq.admitted = True
        return True

    def _grow(self, seq: Sequence, num_tokens: int, now: float, copies: list[BlockCopy]) -> bool:
        """Make ``seq`` hold ``num_tokens``; preempt newer sequences if needed."""
        while len(seq.block_slots) * self.tokens_per_block < num_tokens:
            grown = self.pool.extend(seq.request_id, num_tokens, now=now)
            if grown is not None:
                slots, extra = grown
                copies.extend(extra)
                seq.block_slots = list(slots)  # generation blocks are not in the per-request metrics
                return True
            # max_utilization's pause; under guaranteed_no_evict a safety net only (admission
            # reserved every running request's blocks to completion).
            victim = max(self.running, key=lambda s: s.admit_seq)
            self.preempt(victim, now)
            if victim is seq:
                return False
        return True

    def store_computed(self, step: ScheduledStep) -> None:
        """After ``step`` ran, before its sampled tokens join their sequences: store for reuse what
        TensorRT-LLM stores then (``BlockPool.store``). A prefill that finished stores the full
        blocks of all its tokens but the last (``storeContextBlocks``: ``tokens[:promptLen - 1]``);
        a decode step stores them when the sequence's tokens but the last fill whole blocks, one
        block or more (``WindowBlockManager::storeNewBlock`` in ``kvCacheManager.cpp``: it returns
        unless ``usableSize = uniqueTokens.size() - 1``, the tokens before this step's sample, is a
        multiple of the block size; with ``blockKeys.size() < 2`` it stores all blocks, so a prompt
        shorter than one block has its first block stored when decoding fills it)."""
        bpt = self.tokens_per_block
        for work in step.prefills:
            if work.sample:  # the last chunk: the prefill is done
                self._store(work.seq, work.seq.num_computed - 1)
        for work in step.decodes:
            usable = work.seq.num_computed - 1  # the token fed this step was the last one sampled
            if usable > 0 and usable % bpt == 0:
                self._store(work.seq, usable)

    def _store(self, seq: Sequence, num_tokens: int) -> None:
        if seq in self.running:  # not preempted by a later sequence's growth in the same step
            self.pool.store(seq.request_id, seq.tokens, num_computed_tokens=num_tokens)

    # Lifecycle ------------------------------------------------------------------------
    def preempt(self, seq: Sequence, now: float) -> None:
        """Release ``seq``'s blocks and put it back at the head of the queue."""
        self._release(seq, now)
        seq.prefill_target = len(seq.tokens)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, now: float) -> None:
        if seq in self.running:
            self._release(seq, now)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    def _release(self, seq: Sequence, now: float) -> None:
        self.running.remove(seq)
        self.pool.release(seq.request_id, seq.tokens, now=now, num_computed_tokens=seq.num_computed)
        seq.block_slots = []
        seq.num_computed = 0
