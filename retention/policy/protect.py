"""``protect``: keep a live subset of conversations that fits the GPU; the rest go first.

When the live working set of many conversations is larger than the GPU pool, LRU thrashes:
every conversation's context is evicted during its user's think time, and nearly no turn
finds its history. Protecting a *subset* of the conversations — as many as fit — gives that
subset its hits back while the rest (which LRU would have lost anyway) are evicted first.
This is the scan-resistance idea of LIRS / ARC's protected list, applied per conversation.

Conversations from chained hashes. A block's chain hash names its whole prefix, so a
conversation is a path in the prefix tree, and its turns extend it::

    system prompt (shared)      conversation A (private)         conversation B (private)
    s0 ─ s1 ─ s2 ─ s3 ─┬─ a0 ─ a1 ─ a2 ─ a3 …       turn t+1 extends turn t's chain
                       └─ b0 ─ b1 …                 s3 has two children: "shared"

:class:`ConversationTracker` remembers, per block hash (bounded LRU map), its first child and
whether a second, different child was ever seen (fan-out ≥ 2: a *shared* block, e.g. a
system prompt or a document). A request's *private part* starts after the deepest shared
block of its chain; its conversation key is the first private block (stable across turns:
every later turn passes through it). A chain with no shared block is one conversation keyed
by its root.

Admission. A conversation is *live* for the ``live_quantile`` (the median) of the measured
revisit gaps after its last request (bounded reservoir). The tracker keeps the live
protected footprint (private blocks of the live protected conversations, at their latest
length); a request of a conversation that is not live-protected is admitted (protected from
now on) iff its private blocks fit under ``share × primary_blocks``. Protected conversations
are never demoted while live; one that goes quiet leaves the footprint and is admitted afresh
when it returns.

Plan (``T`` = the pool's offload threshold)::

    shared prefix + protected private blocks  → max(45, T + 1) for the live window (ms)
    unprotected private blocks                → uncovered: 35, LRU among them

A protected block whose duration ran out falls back to 35 (``refresh`` in TensorRT-LLM's
``evictionPolicy.cpp``, modelled in ``retention/pool.py``) and ages out by LRU with the
unprotected ones, so finished conversations do not hold the band. Priorities never increase
along a chain (shared ≥ private), so a parent is never evicted before its child. Why a
window of the median gap: holding a history for D yields F(D) / E[min(gap, D)] hits per
block-second, which for lognormal think times peaks near the median (measured on the tune
family ``chat``: the 0.3 / 0.5 / 0.6 quantiles gave 37.2 / 38.1 / 37.2 % at 2 % GPU).
With a host tier the duration would be cleared on offload (the band pinned in host memory
for good), which is why the selector offers this candidate in GPU-only pools only.

Bounds: ``max_blocks`` remembered hashes and ``max_conversations`` conversations (oldest
forgotten first), a fixed gap reservoir; O(blocks) dict work per request. By default both
scale with the pool (``ProtectConfig.caps``): 8 × its GPU blocks of hashes (4,096 to 400 k)
and 2 × its GPU blocks of conversations (1,024 to 100 k) — a block forgotten after 8 pool
turnovers is long gone from the GPU, and on the chat families a cap of 8 × planned the same
as 400 k (hit rates equal within 0.3 points at 1 and 2 % GPU). Measured with tracemalloc at
400 k hashes and 60 k conversations: 88 MB, about 220 bytes per remembered hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from retention.policy.adaptive import reservoir_add
from retention.types import DEFAULT_PRIORITY, MAX_PRIORITY, RetentionPlan, merged_ranges

PROTECTED_PRIORITY = 45
LIVE_REFRESH = 32  # gaps between re-sorts of the reservoir


@dataclass(frozen=True, slots=True)
class ProtectConfig:
    share: float = 1.0  # live protected footprint target, as a share of the GPU blocks
    live_quantile: float = 0.5  # a conversation is live this long after its last request (of revisit gaps)
    min_live_s: float = 1.0
    max_live_s: float = 3_600.0
    max_blocks: int | None = None  # remembered block hashes; None: scaled to the pool (caps())
    max_conversations: int | None = None  # None: scaled to the pool (caps())
    reservoir: int = 512  # revisit gaps kept for the live window

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0 or not 0.0 < self.live_quantile <= 1.0:
            raise ValueError("share and live_quantile must be within (0, 1]")
        if not 0.0 <= self.min_live_s <= self.max_live_s:
            raise ValueError("need 0 <= min_live_s <= max_live_s")
        if (self.max_blocks is not None and self.max_blocks < 1) or (
                self.max_conversations is not None and self.max_conversations < 1) or self.reservoir < 1:
            raise ValueError("max_blocks, max_conversations and reservoir must be >= 1")

    def caps(self, primary_blocks: int) -> tuple[int, int]:
        """(remembered hashes, conversations) for a pool of ``primary_blocks`` GPU blocks."""
        blocks = self.max_blocks if self.max_blocks is not None else min(400_000, max(4_096, 8 * primary_blocks))
        convs = (self.max_conversations if self.max_conversations is not None
                 else min(100_000, max(1_024, 2 * primary_blocks)))
        return blocks, convs


_NO_CHILD = -1


@dataclass(slots=True)
class _Node:
    child: int = _NO_CHILD  # first child's hash
    shared: bool = False  # a second, different child was seen


@dataclass(slots=True)
class _Conversation:
    last_seen: float
    blocks: int  # private blocks at the latest request
    protected: bool = False


@dataclass(slots=True)
class ConversationTracker:
    """Prefix tree fan-out + live protected conversations for one pool; pure, caller passes ``now``.

    Invariant: ``footprint`` = Σ blocks of the conversations in ``_live`` (protected, last
    seen within the live window as of the last :meth:`observe`).
    """

    primary_blocks: int
    config: ProtectConfig = ProtectConfig()
    footprint: int = 0
    _nodes: OrderedDict[int, _Node] = field(default_factory=OrderedDict)
    _conversations: OrderedDict[int, _Conversation] = field(default_factory=OrderedDict)
    _live: OrderedDict[int, _Conversation] = field(default_factory=OrderedDict)  # protected, by last_seen
    _gaps: list[float] = field(default_factory=list)
    _gap_count: int = 0
    _live_s: float | None = None  # cached quantile; refreshed every LIVE_REFRESH gaps
    _max_blocks: int = field(init=False, default=0)
    _max_conversations: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._max_blocks, self._max_conversations = self.config.caps(self.primary_blocks)

    def live_s(self) -> float:
        """The live window: the ``live_quantile`` of the measured revisit gaps (``max_live_s`` before any)."""
        if self._live_s is None:
            cfg = self.config
            if not self._gaps:
                return cfg.max_live_s
            ordered = sorted(self._gaps)
            value = ordered[min(len(ordered) - 1, int(cfg.live_quantile * len(ordered)))]
            self._live_s = min(cfg.max_live_s, max(cfg.min_live_s, value))
        return self._live_s

    def split(self, hashes: Sequence[int]) -> tuple[int, int | None]:
        """(private start, conversation key) of a chain; key ``None`` for a chain with no private block.

        A block whose remembered first child differs from this chain's next block counts as
        shared already (this request is its second child).
        """
        nodes = self._nodes
        start = 0
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                break
            if node.shared or (i + 1 < len(hashes) and node.child not in (_NO_CHILD, hashes[i + 1])):
                start = i + 1
        return start, (hashes[start] if start < len(hashes) else None)

    def protected(self, key: int | None, private_blocks: int, now: float) -> bool:
        """Whether the conversation's private blocks get the protected band (admits if it fits). Pure query."""
        if key is None:
            return True  # nothing private: the whole chain is shared
        conv = self._live.get(key)
        if conv is not None and now - conv.last_seen <= self.live_s():
            return True
        return self._live_footprint(now) + private_blocks <= self.config.share * self.primary_blocks

    def _live_footprint(self, now: float) -> int:
        """Footprint without the conversations that went quiet by ``now`` (pure)."""
        horizon = now - self.live_s()
        stale = 0
        for conv in self._live.values():
            if conv.last_seen >= horizon:
                break
            stale += conv.blocks
        return self.footprint - stale

    def observe(self, hashes: Sequence[int], now: float, *, num_blocks: int) -> None:
        """Record one request (after planning it): fan-out, the conversation, the live footprint."""
        start, key = self.split(hashes)
        protect = self.protected(key, num_blocks - start, now)
        self._expire(now)
        self._record_tree(hashes)
        if key is None:
            return
        convs = self._conversations
        conv = convs.get(key)
        if conv is None:
            conv = convs[key] = _Conversation(now, 0)
            if len(convs) > self._max_conversations:
                old_key, old = convs.popitem(last=False)
                if self._live.pop(old_key, None) is not None:
                    self.footprint -= old.blocks
        else:
            convs.move_to_end(key)
            self._record_gap(now - conv.last_seen, key)
        live = self._live.pop(key, None)
        if live is not None:
            self.footprint -= live.blocks
        conv.last_seen = now
        conv.blocks = max(0, num_blocks - start)
        conv.protected = protect
        if protect:
            self._live[key] = conv
            self.footprint += conv.blocks

    def _expire(self, now: float) -> None:
        horizon = now - self.live_s()
        while self._live:
            key, conv = next(iter(self._live.items()))
            if conv.last_seen >= horizon:
                break
            del self._live[key]
            self.footprint -= conv.blocks

    def _record_tree(self, hashes: Sequence[int]) -> None:
        nodes = self._nodes
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                node = nodes[h] = _Node()
            else:
                nodes.move_to_end(h)
            if i + 1 < len(hashes):
                nxt = hashes[i + 1]
                if node.child == _NO_CHILD:
                    node.child = nxt
                elif node.child != nxt:
                    node.shared = True
        while len(nodes) > self._max_blocks:
            nodes.popitem(last=False)

    def _record_gap(self, gap: float, salt: int) -> None:
        """Reservoir sampling with a deterministic index (reproducible runs, no RNG state)."""
        self._gap_count += 1
        if self._gap_count % LIVE_REFRESH == 1 or self._gap_count <= LIVE_REFRESH:
            self._live_s = None  # sorting the reservoir on every request would dominate the cost
        reservoir_add(self._gaps, gap, count=self._gap_count, salt=salt, size=self.config.reservoir)


def protect_priorities(offload_min_priority: int) -> tuple[int, int]:
    """(protected, unprotected) priorities for a pool's offload threshold ``T``: (max(45, T+1), 35).

    Unprotected blocks are simply left at the default 35 (a protected block whose duration
    ran out joins them there, LRU among them); the protected band sits above, and above
    ``T`` so that with a host tier it would be offloaded, never dropped.
    """
    return min(MAX_PRIORITY, max(PROTECTED_PRIORITY, offload_min_priority + 1)), DEFAULT_PRIORITY


def protect_plan(tracker: ConversationTracker, hashes: Sequence[int], *, num_tokens: int, tokens_per_block: int,
                 now: float, offload_min_priority: int, decode_priority: int = 0) -> RetentionPlan:
    """The request's plan: shared prefix and protected private blocks high, the rest low (module docstring)."""
    high, low = protect_priorities(offload_min_priority)
    duration = int(tracker.live_s() * 1000)
    num_blocks = -(-num_tokens // tokens_per_block)
    start, key = tracker.split(hashes)
    private = high if tracker.protected(key, num_blocks - start, now) else low
    cut = min(start, num_blocks) * tokens_per_block
    spans = [(0, cut, high, duration), (cut, num_blocks * tokens_per_block, private, duration if private == high else None)]
    return RetentionPlan(merged_ranges(spans), decode_priority, None)


@dataclass(slots=True)
class ProtectPolicy:
    """The simulator's ``protect``: the candidate alone, no selection (for comparison, like ``adaptive-bands``).

    Plans each request once (with ``--hold tokens`` a waiting request is planned again on
    every admission attempt, and the tracker must record it once).
    """

    config: ProtectConfig = ProtectConfig()
    offload_min_priority: int = 30
    name: str = "protect"
    uses_host: bool = True
    tracker: ConversationTracker | None = None
    _last: tuple[int, RetentionPlan] | None = None

    def plan(self, request, hashes, *, now, pool) -> RetentionPlan:  # noqa: ANN001 - SimPolicy protocol
        if self._last is not None and self._last[0] == request.index:
            return self._last[1]
        if self.tracker is None:
            self.tracker = ConversationTracker(pool.config.primary_blocks, self.config)
        bpt = pool.config.tokens_per_block
        plan = protect_plan(self.tracker, hashes, num_tokens=request.input_length, tokens_per_block=bpt, now=now,
                            offload_min_priority=self.offload_min_priority)
        self.tracker.observe(hashes, now, num_blocks=-(-request.input_length // bpt))
        self._last = (request.index, plan)
        return plan

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - SimPolicy protocol
        return None  # recorded when planned
