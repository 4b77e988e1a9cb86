"""Retention planner: a tenant's class + a request's segments → a :class:`RetentionPlan`.

The plan is shaped like TensorRT-LLM's ``KvCacheRetentionConfig``
(``cpp/include/tensorrt_llm/executor/executor.h``): sorted, non-overlapping
``TokenRangeRetentionConfig(token_start, token_end, priority, duration_ms)`` over prompt
tokens (``token_end=None`` = to the end), plus the decode priority/duration.

    tokens   0 ─────── system_end ─────── context_end ─────── total
    segment  |  system   |      context       |       turn      |   (+ generated: decode)
    range    |  (s.prio) |     (c.prio)       |     (t.prio)    → last range open-ended

Rules: an empty segment yields no range; neighbours with equal (priority, duration) merge;
the last range is open-ended so it also covers a prompt that grew by a few tokens (a
chat template's trailing generation prompt). Over quota, every range and the decode
retention drop to priority 0 (``kMinRetentionPriority``) with no duration, so the
tenant's new blocks are the first victims and are never offloaded (0 is below any
offload threshold > 0), and ``plan.demoted`` is set.

``offload_min_priority`` is the pool's ``secondary_offload_min_priority``: the planner
checks it is a valid priority and records nothing else; classes are *positioned*
relative to it (above → evicted blocks go to host, below → dropped) when they are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.types import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    RetentionPlan,
    RetentionPlanError,
    TokenRange,
    check_duration,
    filled,
    merged_ranges,
    check_priority,
)


@dataclass(frozen=True, slots=True)
class SegmentRetention:
    priority: int
    duration_ms: int | None = None

    def __post_init__(self) -> None:
        check_priority(self.priority)
        check_duration(self.duration_ms)


@dataclass(frozen=True, slots=True)
class RetentionClassSpec:
    system: SegmentRetention
    context: SegmentRetention
    turn: SegmentRetention
    decode: SegmentRetention

    def __post_init__(self) -> None:
        for name in ("system", "context", "turn", "decode"):
            if not isinstance(getattr(self, name), SegmentRetention):
                raise RetentionPlanError(f"retention class {name} must be a SegmentRetention", field=name)


@dataclass(frozen=True, slots=True)
class Segments:
    """Token boundaries: [0, system_end) system, [system_end, context_end) context, [context_end, total) turn."""

    system_end: int
    context_end: int
    total: int

    def __post_init__(self) -> None:
        for name in ("system_end", "context_end", "total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RetentionPlanError(f"segments.{name} must be an integer >= 0, got {value!r}", field=name)
        if not self.system_end <= self.context_end <= self.total:
            raise RetentionPlanError(
                f"segments must satisfy system_end <= context_end <= total, got "
                f"{self.system_end} <= {self.context_end} <= {self.total}",
                field="segments",
            )
        if self.total == 0:
            raise RetentionPlanError("segments.total must be > 0 (a prompt has at least one token)", field="total")


@dataclass(frozen=True, slots=True)
class QuotaState:
    over_quota: bool = False


DEMOTED = SegmentRetention(MIN_PRIORITY, None)


def plan_retention(
    cls: RetentionClassSpec,
    segments: Segments,
    *,
    offload_min_priority: int,
    quota: QuotaState = QuotaState(),
) -> RetentionPlan:
    """Build the request's plan. Invariant: the result covers ``[0, total)`` with no gap.

    Raises :class:`RetentionPlanError` naming the bad input (class, segments, threshold).
    """
    if not isinstance(cls, RetentionClassSpec):
        raise RetentionPlanError("cls must be a RetentionClassSpec", field="cls")
    if not isinstance(segments, Segments):
        raise RetentionPlanError("segments must be a Segments", field="segments")
    if isinstance(offload_min_priority, bool) or not isinstance(offload_min_priority, int) or not (
        MIN_PRIORITY <= offload_min_priority <= MAX_PRIORITY + 1
    ):
        raise RetentionPlanError(
            f"offload_min_priority must be an integer within [0, 101], got {offload_min_priority!r}",
            field="offload_min_priority",
        )
    demote = quota.over_quota
    parts = (
        (0, segments.system_end, cls.system),
        (segments.system_end, segments.context_end, cls.context),
        (segments.context_end, segments.total, cls.turn),
    )
    kept = [(start, end, DEMOTED if demote else r) for start, end, r in parts]
    ranges = merged_ranges((start, end, r.priority, r.duration_ms) for start, end, r in kept)
    decode = DEMOTED if demote else cls.decode
    return RetentionPlan(ranges, decode.priority, decode.duration_ms, demoted=demote)


def offloads(retention: SegmentRetention, offload_min_priority: int) -> bool:
    """Whether blocks kept at this retention go to the host tier when evicted (inclusive threshold)."""
    return retention.priority >= offload_min_priority


def demote(plan: RetentionPlan) -> RetentionPlan:
    """The over-quota form of any plan (e.g. an adaptive one): one open range at priority 0.

    Same result as planning with ``QuotaState(over_quota=True)``: every prompt block and
    the decode blocks at ``kMinRetentionPriority`` with no duration, ``demoted`` set.
    """
    ranges = (TokenRange(0, None, MIN_PRIORITY, None),) if plan.ranges else ()
    return RetentionPlan(ranges, MIN_PRIORITY, None, demoted=True)


def roll_back_host_tier(plan: RetentionPlan, offload_min_priority: int) -> RetentionPlan:
    """The plan with the host tier rolled back: every block it plans is kept below the
    pool's offload threshold, so when evicted it is dropped, never offloaded (SLO guard).

    Priorities are clamped to ``offload_min_priority - 1`` (``min``): the order between
    ranges is kept (non-strictly: priorities above the clamp become equal), ranges are not
    merged (same token boundaries); prompt tokens no range covers get an explicit range.
    Durations are kept only if the priority a block falls
    back to when its duration expires (35, ``kDefaultRetentionPriority``) is itself below
    the threshold; otherwise they are dropped (``None`` = never expires), because an expired
    block at 35 would be offloaded again ("Priority reverts to the default of 35 after a
    period of duration_ms", NVIDIA/TensorRT-LLM ``docs/source/features/kvcache.md``,
    Retention Policy). Invariant: for ``offload_min_priority >= 1`` no
    block planned by the result offloads, at any time. A threshold of 0 offloads everything
    (no priority is below it): the plan is returned unchanged.

        threshold 30:  [0,96)@90/∞  [96,128)@60/600s  decode@20/30s
                   →   [0,96)@29/∞  [96,128)@29/∞     decode@20/∞
    """
    if isinstance(offload_min_priority, bool) or not isinstance(offload_min_priority, int) or not (
        MIN_PRIORITY <= offload_min_priority <= MAX_PRIORITY + 1
    ):
        raise RetentionPlanError(
            f"offload_min_priority must be an integer within [0, 101], got {offload_min_priority!r}",
            field="offload_min_priority",
        )
    if offload_min_priority == MIN_PRIORITY:
        return plan
    ceiling = offload_min_priority - 1
    keep_durations = DEFAULT_PRIORITY < offload_min_priority

    def duration(value: int | None) -> int | None:
        return value if keep_durations else None

    # Prompt tokens no range covers get 35 in TensorRT-LLM (when new): cover every gap
    # explicitly, so the result holds whatever plan it is given.
    ranges = filled((TokenRange(r.start, r.end, min(r.priority, ceiling), duration(r.duration_ms)) for r in plan.ranges),
                    min(DEFAULT_PRIORITY, ceiling))
    return RetentionPlan(ranges, min(plan.decode_priority, ceiling), duration(plan.decode_duration_ms),
                         demoted=plan.demoted)
