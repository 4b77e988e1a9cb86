"""Client cache hints → retention ranges, bounded by the tenant's class.

:class:`~retention.policy.hints.CacheHints` (what a client said) becomes token ranges with a
priority and a duration laid over the plan the class (or adaptive selection) already made.
The class decides everything a client may not: whether hints count at all, the longest
duration, the one priority hinted tokens get, and the share of the tenant's KV quota
hinted blocks may hold (that budget is :mod:`retention.policy.hint_quota`'s; here it arrives as
``allowed_tokens``).

Mapping (``HintPolicy`` = the class's hint fields)::

    breakpoint i, TTL t_i  →  [bp[i-1].token_end, bp[i].token_end)  for min(max(t_j, j >= i), max_ttl_ms)
                              (a breakpoint keeps its whole prefix: a later, longer TTL extends earlier tokens)
    retention "24h"        →  [0, total)  for max_ttl_ms   (the longest the class allows, whole prompt)
    retention "in_memory"  →  nothing: the class's own plan  (the class default)
    prompt_cache_key       →  nothing here (it never keys a plan, so it cannot cross a salt)

    base plan   |  sys 90/∞  |   context 60/600 s   |    turn 35/30 s    |
    hint span   |<──────────── 1 h ───────────>|<── 5 min ──>|
    result      |  sys 90/∞  | 60/1 h (longer) | 60/1 h |60/5m|  35/30 s |   (max_priority 60)

Per token, a hint only ever strengthens the base plan: where ``max_priority`` is above the
base priority the token takes ``(max_priority, hint duration)``; at equal priority the
longer duration wins (``None`` = never expires is longest); where the base priority is
higher the base stays (a class's pinned system prompt is not shortened to a TTL).
TensorRT-LLM semantics apply to the result as to any plan: a duration starts when the block
is released and on expiry the block falls back to priority 35 (``retention/types.py``).
With ``max_priority >= secondary_offload_min_priority`` hinted blocks are offloaded to the
host tier on GPU eviction instead of dropped; the class chooses that, not the client.

Invariants: without hints, with a class that forbids them, with ``retention`` "in_memory"
and no breakpoints, or for a demoted (over-quota) plan, :func:`apply_hints` returns the
*same* plan object (byte-identical engine requests); otherwise every token's priority in
the result is ``>=`` its priority in the base plan and ``<= max(base, max_priority)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.policy.hints import TTL_1H_MS, CacheHints
from retention.types import (
    RetentionPlan,
    RetentionPlanError,
    check_duration,
    check_priority,
    merged_ranges,
)

DEFAULT_HINT_MAX_TTL_MS = TTL_1H_MS
DEFAULT_HINT_MAX_PRIORITY = 60
DEFAULT_HINT_QUOTA_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class HintPolicy:
    """A retention class's rules for client hints (registry: ``retention_classes.hint_*``)."""

    enabled: bool = False
    max_ttl_ms: int = DEFAULT_HINT_MAX_TTL_MS
    max_priority: int = DEFAULT_HINT_MAX_PRIORITY
    quota_fraction: float = DEFAULT_HINT_QUOTA_FRACTION  # of the tenant's KV quota

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise RetentionPlanError("hints_enabled must be a boolean", field="hints_enabled")
        check_duration(self.max_ttl_ms, field="hint_max_ttl_ms")
        if self.max_ttl_ms is None or self.max_ttl_ms <= 0:
            raise RetentionPlanError("hint_max_ttl_ms must be an integer > 0", field="hint_max_ttl_ms")
        check_priority(self.max_priority, field="hint_max_priority")
        fraction = self.quota_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise RetentionPlanError(f"hint_quota_fraction must be within (0, 1], got {fraction!r}",
                                     field="hint_quota_fraction")

    def budget_blocks(self, kv_quota_fraction: float, primary_blocks: int) -> int:
        """Blocks the tenant may hold under hints: this share of its KV quota, in whole blocks."""
        return int(self.quota_fraction * kv_quota_fraction * primary_blocks)


HINTS_OFF = HintPolicy()


@dataclass(frozen=True, slots=True)
class HintSpan:
    """Prompt tokens ``[start, end)`` a hint asks to keep for ``duration_ms`` (already capped)."""

    start: int
    end: int
    duration_ms: int


def hint_spans(hints: CacheHints, policy: HintPolicy, total: int) -> tuple[HintSpan, ...]:
    """The capped spans ``hints`` ask for over a prompt of ``total`` tokens; ``()`` when none count."""
    if not policy.enabled or total <= 0:
        return ()
    if hints.retention == "24h":  # the longest the class allows covers every breakpoint too
        return (HintSpan(0, total, policy.max_ttl_ms),)
    spans: list[HintSpan] = []
    start = 0
    points = hints.breakpoints
    for index, point in enumerate(points):
        end = min(point.token_end, total)
        if end > start:
            ttl = max(p.ttl_ms for p in points[index:])  # later breakpoints cover this prefix too
            spans.append(HintSpan(start, end, min(ttl, policy.max_ttl_ms)))
        start = max(start, end)
    return tuple(spans)


def clip_spans(spans: tuple[HintSpan, ...], allowed_tokens: int) -> tuple[HintSpan, ...]:
    """``spans`` cut to ``[0, allowed_tokens)`` (the quota share's cut, see :mod:`retention.policy.hint_quota`)."""
    out = []
    for span in spans:
        end = min(span.end, allowed_tokens)
        if end > span.start:
            out.append(HintSpan(span.start, end, span.duration_ms))
    return tuple(out)


def _longer(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)


def apply_hints(plan: RetentionPlan, spans: tuple[HintSpan, ...], policy: HintPolicy, total: int) -> RetentionPlan:
    """``plan`` strengthened by ``spans`` (see the module docstring for the rule per token).

    Returns ``plan`` itself when nothing applies (no spans, hints off, demoted plan).
    """
    if not spans or not policy.enabled or plan.demoted:
        return plan
    cuts = {0, total}
    for rng in plan.ranges:
        cuts.add(min(rng.start, total))
        if rng.end is not None:
            cuts.add(min(rng.end, total))
    for span in spans:
        cuts.update((span.start, span.end))
    points = sorted(c for c in cuts if 0 <= c <= total)
    pieces = []
    for start, end in zip(points, points[1:]):
        priority, duration = plan.retention_at(start)
        hint = next((s for s in spans if s.start <= start < s.end), None)
        if hint is not None:
            if policy.max_priority > priority:
                priority, duration = policy.max_priority, hint.duration_ms
            elif policy.max_priority == priority:
                duration = _longer(duration, hint.duration_ms)
        pieces.append((start, end, priority, duration))
    # Tokens past ``total`` (a template's trailing tokens) keep what the base plan's open
    # range gave them: the merged last range is open-ended and carries the last piece's retention.
    return RetentionPlan(merged_ranges(pieces), plan.decode_priority, plan.decode_duration_ms, demoted=plan.demoted)


def hinted_block_count(spans: tuple[HintSpan, ...], tokens_per_block: int) -> int:
    """Blocks whose first token lies in a span (TensorRT-LLM: a block takes its first token's range)."""
    if not spans:
        return 0
    end = max(s.end for s in spans)
    return sum(1 for b in range(-(-end // tokens_per_block)) if any(s.start <= b * tokens_per_block < s.end for s in spans))


__all__ = ["HINTS_OFF", "HintPolicy", "HintSpan", "apply_hints", "clip_spans", "hint_spans",
           "hinted_block_count"]
