"""How many blocks a tenant holds under hints: the bound behind ``hint_quota_fraction``.

The engines report blocks per tenant and tier (the KV quota's input), not which of them a
hint raised. So the ledger counts from the plans themselves, conservatively: every full
prompt block a hint covered is *live* from the request that hinted it until its hinted
duration has run out after its last hinted use, whether or not the engine still holds it
(an evicted block is still counted). The count is therefore an upper bound on the hinted
blocks the engine holds, and keeping it under the budget keeps the real figure under too.

    blocks of a hinted prompt   h0 h1 h2 h3 h4 h5       (full-block chain hashes, salted)
    already live for the tenant h0 h1                    (counted once)
    budget 4, live 2            h0 h1 h2 h3 | h4 h5      → the hint stops at h4: 4 blocks allowed

Keys are (tenant, salted block hash): one tenant's entries never count against, or match,
another's, whatever its isolation. Pure: the caller passes ``now`` (seconds, any monotonic
clock) and calls :meth:`HintLedger.record` when it plans and again when the request ends
(TensorRT-LLM starts a duration when the block is released).

**The hold is measured, the TTL is the client's bound.** A TTL says how long a client *may*
come back, not when it will: an agent run's last conversation is marked 5 min like every
step before it and never returns. Held at the hinted priority for the whole TTL, such dead
blocks crowd live ones out of a small GPU (and fill the budget, so live runs lose their
hints). So the ledger measures, per tenant, how long hinted prompts actually wait before
they come back, and shortens the hold only when many requests show that they come back much
sooner than the TTL:

* **one gap per request**: the time since the request's longest reused hinted prefix (its
  deepest block still inside a client window) was last seen (used or released), measured
  within the client's window, so the hold does not censor it. A 16-block prompt sent again
  is one sample, not 16;
* **retries do not count**: a gap under ``RETRY_GAP_S`` (an SDK retry, a duplicate sent at
  once) is no evidence of when a client returns and is ignored;
* **per TTL class**: gaps are kept apart for hints of at most 5 min and longer ones (1 h, 24 h,
  as capped by the class), by the TTL the reused block was hinted with; one class's fast
  repeats never shorten the other's hints;
* **only with evidence**: a span hinted for ``ttl`` is held for ``ttl`` until its class has
  ``MIN_GAP_SAMPLES`` gaps (distinct requests), then for
  ``min(ttl, max(MIN_HOLD_MS, GAP_MARGIN × the class's GAP_QUANTILE gap, GAP_MARGIN × this
  request's own gap))``: never longer than the client asked, never shorter than the prefix
  this request reuses has itself been shown to wait.

After the hold the block falls back to 35 (TensorRT-LLM's expiry) and stays cached as any
other block would. Memory: per tenant the entries inside the client's window (at most
``MAX_TRACKED``; the oldest unpinned go first) and ``GAP_SAMPLES`` gaps per TTL class.

The ledger is state of one gateway process (one per pool there): with N gateway replicas a
tenant may hold up to N × its hint budget under hints; the engine-reported KV quota still
bounds the tenant as a whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from retention.policy.hint_plan import HintPolicy, HintSpan, apply_hints, clip_spans, hint_spans
from retention.policy.hints import TTL_1H_MS, TTL_5M_MS, CacheHints
from retention.types import RetentionPlan


GAP_SAMPLES = 256  # recent reuse gaps kept per tenant and TTL class
MIN_GAP_SAMPLES = 16  # gaps (one per request) a TTL class needs before its hold replaces the TTL
GAP_QUANTILE = 0.9
GAP_MARGIN = 2.0
MIN_HOLD_MS = 1_000
RETRY_GAP_S = 1.0  # a request back sooner than this is a retry or a duplicate: not a gap
MAX_TRACKED = 65_536  # entries per tenant inside the client's window

TtlClass = Literal["5m", "1h"]


def ttl_class(ttl_ms: int) -> TtlClass:
    """The gap statistics a TTL belongs to: ``"5m"`` (at most 5 min) or ``"1h"`` (longer: 1 h, 24 h)."""
    return "5m" if ttl_ms <= TTL_5M_MS else "1h"


@dataclass(slots=True)
class _Entry:
    pinned_until: float  # the hinted priority's duration ends (what the engine was told; the budget counts it)
    window_until: float  # the client's TTL ends: a use before it is a measured gap
    seen: float  # last use or release
    window_ms: int  # the longest client window recorded for it (its TTL class)
    promised_until: float = 0.0  # the latest *hinted* use's hold end: what later reads keep (never extend)


@dataclass(slots=True)
class _TenantHints:
    entries: dict[int, _Entry] = field(default_factory=dict)  # insertion order = least recently recorded first
    gaps: dict[TtlClass, deque[float]] = field(default_factory=lambda: {
        "5m": deque(maxlen=GAP_SAMPLES), "1h": deque(maxlen=GAP_SAMPLES)})
    pinned_until: float = 0.0  # the latest hold end recorded (so "any pin left?" costs O(1) per request)


@dataclass(slots=True)
class HintLedger:
    """Per tenant: salted block hash -> its hinted hold, the client's window, its last use; and
    the measured reuse gaps of hinted prompts (one per request, per TTL class)."""

    _tenants: dict[str, _TenantHints] = field(default_factory=dict)

    def _forget_closed(self, hints: _TenantHints, now: float) -> None:
        closed = [h for h, e in hints.entries.items() if e.window_until <= now and e.pinned_until <= now]
        for h in closed:
            del hints.entries[h]

    def live_blocks(self, tenant: str, now: float) -> int:
        """Hinted blocks of ``tenant`` still held at the hinted priority; forgets closed windows."""
        hints = self._tenants.get(tenant)
        if hints is None:
            return 0
        self._forget_closed(hints, now)
        return sum(1 for e in hints.entries.values() if e.pinned_until > now)

    def allowance(self, tenant: str, hashes: Sequence[int], budget_blocks: int, now: float) -> int:
        """How many leading blocks of ``hashes`` may be hinted without the tenant's live
        hinted blocks exceeding ``budget_blocks`` (blocks already live cost nothing)."""
        live = self.live_blocks(tenant, now)
        entries = self._tenants[tenant].entries if tenant in self._tenants else {}
        allowed = 0
        for h in hashes:
            entry = entries.get(h)
            if entry is None or entry.pinned_until <= now:
                if live >= budget_blocks:
                    break
                live += 1
            allowed += 1
        return allowed

    def gap_count(self, tenant: str, ttl_ms: int) -> int:
        """Gaps measured for ``tenant``'s hints of ``ttl_ms``'s TTL class."""
        hints = self._tenants.get(tenant)
        return 0 if hints is None else len(hints.gaps[ttl_class(ttl_ms)])

    def hold_ms(self, tenant: str, ttl_ms: int, *, gap: float | None = None) -> int:
        """How long to hold a block hinted for ``ttl_ms`` at the hinted priority (module
        docstring): the TTL until its class has ``MIN_GAP_SAMPLES`` gaps, then
        ``min(ttl_ms, max(MIN_HOLD_MS, GAP_MARGIN × the class's quantile, GAP_MARGIN × gap))``,
        where ``gap`` is the request's own measured gap (:meth:`observe_use`), if any."""
        hints = self._tenants.get(tenant)
        gaps = None if hints is None else hints.gaps[ttl_class(ttl_ms)]
        if gaps is None or len(gaps) < MIN_GAP_SAMPLES:
            return ttl_ms
        ordered = sorted(gaps)
        measured = ordered[min(len(ordered) - 1, int(GAP_QUANTILE * len(ordered)))]
        if gap is not None:
            measured = max(measured, gap)  # this prefix itself waited that long: hold it at least as long
        return min(ttl_ms, max(MIN_HOLD_MS, int(GAP_MARGIN * measured * 1000)))

    def observe_use(self, tenant: str, hashes: Sequence[int], now: float) -> float | None:
        """A new request uses ``hashes`` (its hinted blocks, in prompt order, at plan time):
        one measured gap for the request, since its deepest block still inside a client
        window was last seen (used or released), in that block's TTL class. Returns the gap,
        or None when no block is in a window or the gap is under ``RETRY_GAP_S`` (a retry)."""
        hints = self._tenants.get(tenant)
        if hints is None:
            return None
        deepest = None
        for h in hashes:  # chain hashes: a deeper match implies the whole prefix before it
            entry = hints.entries.get(h)
            if entry is not None and entry.window_until > now:
                deepest = entry
        if deepest is None:
            return None
        gap = now - deepest.seen
        if gap < RETRY_GAP_S:
            return None
        hints.gaps[ttl_class(deepest.window_ms)].append(gap)
        return gap

    def has_pins(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` has a block still held at the hinted priority (cheap: no hashing needed otherwise)."""
        hints = self._tenants.get(tenant)
        return hints is not None and hints.pinned_until > now

    def pins(self, tenant: str, hashes: Sequence[int], now: float) -> list[tuple[int, int] | None]:
        """Per leading block of ``hashes``: (remaining promised hold ms, remaining client window ms)
        while its latest hinted use's hold runs, None for a block the ledger knows but no longer
        holds; up to the first block it does not know (chain hashes: nothing deeper was hinted
        through this prompt). The hold counts from the promise, not from what reads re-told the
        engine, so reading a pinned prefix never extends it."""
        hints = self._tenants.get(tenant)
        out: list[tuple[int, int] | None] = []
        if hints is None:
            return out
        for h in hashes:
            entry = hints.entries.get(h)
            if entry is None:
                break
            if entry.promised_until <= now:
                out.append(None)
                continue
            held = max(1, int((entry.promised_until - now) * 1000))
            out.append((held, max(held, int((entry.window_until - now) * 1000))))
        while out and out[-1] is None:
            out.pop()
        return out

    def record(self, tenant: str, hashes: Sequence[int], durations_ms: Sequence[int], now: float, *,
               windows_ms: Sequence[int] | None = None, promise: bool = True) -> None:
        """Mark ``hashes`` held until ``now + duration`` (the latest use decides, as in the
        engine) and inside the client's window until ``now + window`` (default: the duration;
        the later end is kept); each is seen now. ``promise`` (a hinted use: a client's hint or
        a conversation hold) also sets the promised end later reads keep; a read keeping a pin
        (:func:`keep_pins`) passes False: it re-tells the engine, it promises nothing new."""
        hints = self._tenants.setdefault(tenant, _TenantHints())
        entries = hints.entries
        windows = durations_ms if windows_ms is None else windows_ms
        for h, duration, window in zip(hashes, durations_ms, windows):
            entry = entries.pop(h, None)
            if entry is None or (entry.window_until <= now and entry.pinned_until <= now):
                entry = _Entry(now + duration / 1000.0, now + window / 1000.0, now, window,
                               now + duration / 1000.0 if promise else 0.0)
            elif not promise:
                entry.pinned_until = max(entry.pinned_until, now + duration / 1000.0)
                entry.seen = now
            else:
                # The latest use sets the hold, as the engine does: a reused block takes the new
                # request's priority and duration when it is released (an explicit priority on
                # reuse overrides the old one, kvCacheManager.cpp; docs/architecture.md).
                entry.pinned_until = now + duration / 1000.0
                entry.promised_until = entry.pinned_until
                entry.window_until = max(entry.window_until, now + window / 1000.0)
                entry.window_ms = max(entry.window_ms, window)
                entry.seen = now
            entries[h] = entry  # re-inserted: the dict's order is the recording order
            hints.pinned_until = max(hints.pinned_until, entry.pinned_until)
        if len(entries) > MAX_TRACKED:
            self._forget_closed(hints, now)
            for h in [h for h, e in entries.items() if e.pinned_until <= now][:len(entries) - MAX_TRACKED]:
                del entries[h]


@dataclass(frozen=True, slots=True)
class HintedPlan:
    """A plan after hints, and the blocks they cover (to :meth:`HintLedger.record` again at release)."""

    plan: RetentionPlan
    hashes: tuple[int, ...] = ()
    durations_ms: tuple[int, ...] = ()  # the measured holds the engine was told
    clipped: bool = False  # the quota share cut the hinted tokens short
    windows_ms: tuple[int, ...] = ()  # the client's TTLs (capped by the class) of the same blocks
    # Blocks an earlier hint still holds that this request keeps (keep_pins), apart from its own:
    # recorded at release without a new promise, and never reported as the request's cache writes.
    kept_hashes: tuple[int, ...] = ()
    kept_durations_ms: tuple[int, ...] = ()


def cache_creation(hinted: HintedPlan | None, read: int, tokens_per_block: int) -> tuple[int, int]:
    """(5m, 1h) tokens written under a hint the gateway applied: the hinted blocks (a prefix of
    the prompt's full blocks, :class:`~retention.policy.hint_quota.HintedPlan`) past the ``read``
    tokens served from cache, each by the TTL it was kept for (``windows_ms``: the client's,
    capped by the class). ``(0, 0)`` when no hint applied (``None`` or no blocks)."""
    five = hour = 0
    if hinted is None:
        return five, hour
    for index, window in enumerate(hinted.windows_ms):
        written = max(0, (index + 1) * tokens_per_block - max(index * tokens_per_block, read))
        if window >= TTL_1H_MS:
            hour += written
        else:
            five += written
    return five, hour


def plan_with_hints(plan: RetentionPlan, hints: CacheHints, policy: HintPolicy, *, total: int, tokens_per_block: int,
                    hashes: Sequence[int], ledger: HintLedger, tenant: str, budget_blocks: int,
                    now: float) -> HintedPlan:
    """``plan`` with ``hints`` applied within the class (``policy``) and the tenant's hint budget.

    ``hashes``: the prompt's full-block chain hashes as the engine computes them (salted).
    The hinted tokens are cut at the first block the budget has no room for; the blocks kept
    are recorded in ``ledger``. Returns ``HintedPlan(plan)`` (the same plan object) when no
    hint applies: hints off, no span, a demoted plan, or no room at all.
    """
    # Only full blocks are counted in the ledger, so only full blocks are hinted: the
    # prompt's partial tail block keeps the class's retention.
    spans = clip_spans(hint_spans(hints, policy, total), len(hashes) * tokens_per_block)
    if not spans or plan.demoted:
        return HintedPlan(plan)
    blocks = [b for b in range(-(-max(s.end for s in spans) // tokens_per_block))
              if any(s.start <= b * tokens_per_block < s.end for s in spans)]
    # Hinted blocks form a prefix of the prompt (spans start at 0 and touch), so the
    # allowance over them in order is a token cut.
    hinted_hashes = [hashes[b] for b in blocks]
    allowed = ledger.allowance(tenant, hinted_hashes, budget_blocks, now)
    clipped = allowed < len(blocks)
    if clipped:
        cut = blocks[allowed] * tokens_per_block
        spans = clip_spans(spans, cut)
    if not spans:
        return HintedPlan(plan, clipped=clipped)
    kept = blocks[:allowed]
    windows = tuple(next(s.duration_ms for s in spans if s.start <= b * tokens_per_block < s.end) for b in kept)
    kept_hashes = tuple(hashes[b] for b in kept)
    gap = ledger.observe_use(tenant, kept_hashes, now)  # one gap for the request, at most
    # The measured hold replaces the TTL as the blocks' duration; the window stays the TTL.
    held = tuple(HintSpan(s.start, s.end, ledger.hold_ms(tenant, s.duration_ms, gap=gap)) for s in spans)
    durations = tuple(next(s.duration_ms for s in held if s.start <= b * tokens_per_block < s.end) for b in kept)
    ledger.record(tenant, kept_hashes, durations, now, windows_ms=windows)
    return HintedPlan(apply_hints(plan, held, policy, total), kept_hashes, durations, clipped, windows)


def keep_pins(hinted: HintedPlan, pins: Sequence[tuple[int, int] | None], policy: HintPolicy, *, total: int,
              tokens_per_block: int, hashes: Sequence[int], ledger: HintLedger, tenant: str, now: float) -> HintedPlan:
    """``hinted`` with the tenant's blocks still pinned by an earlier hint kept pinned for the rest of
    their promised hold. ``pins``: :meth:`HintLedger.pins` of the prompt's ``hashes``, read *before*
    this request's own hints were planned (planning records them, and the latest use sets a hold).

    Why: TensorRT-LLM gives a reused block the priority and duration of the request that uses it
    last (an explicit priority on reuse overrides the old one, ``kvCacheManager.cpp``), so a request
    without hints (a read without ``cache_control``, an unstored Responses call) sharing a hinted
    prefix would silently drop it to the class's priority. Here every full prompt block the ledger
    holds pinned and this request's own hints do not cover gets ``(max_priority, the rest of its
    promised hold)`` by the hint rule (a token only gains; at the hint priority the longer duration
    wins), so a client's promise lasts as long as it said, whoever reads the prefix meanwhile, and
    no longer: the rest is counted from the promise, so reads never extend it. A block the
    request's own hints cover takes their hold: the latest hinted use sets it, which is how the
    measured hold shortens a TTL nobody comes back within (holding the earlier, longer pin there
    instead cost 10 points of hit rate on the simulator's hinted agent loops at the whole quota
    share). No budget is spent: pinned blocks are already counted live. The kept blocks are
    returned apart (``kept_hashes``) from the request's own. A demoted (over-quota) plan or a class
    that no longer honours hints keeps ``hinted`` as it is (the same object).
    """
    if not policy.enabled or hinted.plan.demoted or not any(p is not None for p in pins):
        return hinted
    own = set(hinted.hashes)  # blocks this request's own hints cover: their (measured) hold is the latest use
    spans: list[HintSpan] = []
    kept: dict[int, int] = {}
    for b, pin in enumerate(pins):  # one span per run of blocks pinned until the same moment
        start, end = b * tokens_per_block, min((b + 1) * tokens_per_block, total)
        if start >= end:
            break
        if pin is None or hashes[b] in own:
            continue
        held = pin[0]
        kept[hashes[b]] = held
        if spans and spans[-1].duration_ms == held and spans[-1].end == start:
            spans[-1] = HintSpan(spans[-1].start, end, held)
        else:
            spans.append(HintSpan(start, end, held))
    plan = apply_hints(hinted.plan, tuple(spans), policy, total)
    if plan is hinted.plan:
        return hinted
    ledger.record(tenant, list(kept), list(kept.values()), now, promise=False)
    return HintedPlan(plan, hinted.hashes, hinted.durations_ms, hinted.clipped, hinted.windows_ms,
                      tuple(kept), tuple(kept.values()))
