"""Typed vocabulary shared by every layer: priorities, tiers, retention plans.

The shapes mirror TensorRT-LLM release/1.2's ``KvCacheRetentionConfig``
(``cpp/include/tensorrt_llm/executor/executor.h``, class ``KvCacheRetentionConfig``
and its nested ``TokenRangeRetentionConfig``):

* priorities are integers in ``[0, 100]``; the default is 35
  (``kMinRetentionPriority = 0``, ``kMaxRetentionPriority = 100``,
  ``kDefaultRetentionPriority = 35``);
* a token range is ``[token_start, token_end)``, ``token_end=None`` means "to the end
  of the prompt"; ranges are sorted and non-overlapping and only cover prompt tokens;
* a block takes the range that holds its *first* token;
* ``duration_ms=None`` means the priority never expires; once a released block's
  duration has elapsed it falls back to the default priority 35;
* ``decode_retention_priority`` / ``decode_duration_ms`` apply to generated blocks.

Invariant: a constructed :class:`RetentionPlan` is always valid (``__post_init__``
refuses anything else with a :class:`RetentionPlanError` that names the problem).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

BlockHash = NewType("BlockHash", int)
TenantId = NewType("TenantId", str)

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
# TensorRT-LLM's *code* default for KvCacheConfig::secondaryOffloadMinPriority is 30
# (inclusive); its docs say 35. kvgate always sets it explicitly.
TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY = 30


class Tier(IntEnum):
    """Cache level, numbered as TensorRT-LLM numbers them (0 = GPU, 1 = host)."""

    PRIMARY = 0
    SECONDARY = 1


class RetentionPlanError(ValueError):
    """A retention plan or range is invalid; ``field`` names the offending part."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_priority(value: int, *, field: str = "priority") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetentionPlanError(f"{field} must be an integer, got {value!r}", field=field)
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise RetentionPlanError(
            f"{field} must be within [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value}", field=field
        )
    return value


def check_duration(value: int | None, *, field: str = "duration_ms") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetentionPlanError(f"{field} must be an integer or None, got {value!r}", field=field)
    if value < 0:
        raise RetentionPlanError(f"{field} must be >= 0 (None = no expiry), got {value}", field=field)
    return value


@dataclass(frozen=True, slots=True)
class TokenRange:
    """``[start, end)`` of prompt tokens kept at ``priority`` for ``duration_ms``.

    ``end=None`` is open-ended (to the end of the prompt), as in TensorRT-LLM.
    """

    start: int
    end: int | None
    priority: int
    duration_ms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise RetentionPlanError(f"range start must be an integer >= 0, got {self.start!r}", field="start")
        if self.end is not None:
            if isinstance(self.end, bool) or not isinstance(self.end, int):
                raise RetentionPlanError(f"range end must be an integer or None, got {self.end!r}", field="end")
            if self.end <= self.start:
                raise RetentionPlanError(
                    f"range end ({self.end}) must be greater than its start ({self.start})", field="end"
                )
        check_priority(self.priority)
        check_duration(self.duration_ms)

    def contains(self, token_index: int) -> bool:
        return token_index >= self.start and (self.end is None or token_index < self.end)


def merged_ranges(spans: Iterable[tuple[int, int, int, int | None]]) -> tuple[TokenRange, ...]:
    """``(start, end, priority, duration_ms)`` spans in order → :class:`TokenRange` s.

    Empty spans are skipped; touching neighbours with equal (priority, duration) merge; the
    last range is open-ended, so it also covers a prompt that grew by a few tokens.
    """
    merged: list[list] = []
    for start, end, priority, duration in spans:
        if end <= start:
            continue
        if merged and merged[-1][1] == start and merged[-1][2] == priority and merged[-1][3] == duration:
            merged[-1][1] = end
        else:
            merged.append([start, end, priority, duration])
    return tuple(
        TokenRange(start, None if index == len(merged) - 1 else end, priority, duration)
        for index, (start, end, priority, duration) in enumerate(merged)
    )


def filled(ranges: Iterable[TokenRange], priority: int, *, end: int | None = None) -> tuple[TokenRange, ...]:
    """``ranges`` (sorted, non-overlapping) with every token before ``end`` they leave uncovered
    in a range of its own at ``priority``, no expiry; ``end=None``: to the end of any prompt.

    TensorRT-LLM gives a *new* block no range covers 35 and leaves a *reused* one at whatever
    priority it had (``KvCacheRetentionConfig::getPerBlockRetentionPriorityDuration``,
    ``executor.h``; ``LRUEvictionPolicy::claimBlock``, ``evictionPolicy.cpp``): an explicit
    range makes both the same.
    """
    out: list[TokenRange] = []
    covered: int | None = 0
    for rng in ranges:
        if rng.start > covered:  # type: ignore[operator]
            out.append(TokenRange(covered, rng.start, priority))  # type: ignore[arg-type]
        out.append(rng)
        covered = rng.end
        if covered is None:
            break
    if covered is not None and (end is None or covered < end):
        out.append(TokenRange(covered, None, priority))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """A request's retention, shaped like ``KvCacheRetentionConfig``.

    Invariants: ``ranges`` sorted by ``start``, pairwise non-overlapping, only the
    last may be open-ended. Tokens not covered by any range keep the default
    priority (35, no expiry), exactly as TensorRT-LLM treats them.
    """

    ranges: tuple[TokenRange, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_ms: int | None = None
    # Why: the planner records which segments it demoted for quota, for metrics/tests.
    demoted: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ranges, tuple):
            object.__setattr__(self, "ranges", tuple(self.ranges))
        check_priority(self.decode_priority, field="decode_priority")
        check_duration(self.decode_duration_ms, field="decode_duration_ms")
        previous: TokenRange | None = None
        for index, rng in enumerate(self.ranges):
            if not isinstance(rng, TokenRange):
                raise RetentionPlanError(f"ranges[{index}] is not a TokenRange", field="ranges")
            if previous is not None:
                if previous.end is None:
                    raise RetentionPlanError(
                        f"ranges[{index - 1}] is open-ended but is not the last range", field="ranges"
                    )
                if rng.start < previous.end:
                    raise RetentionPlanError(
                        f"ranges[{index}] (start {rng.start}) overlaps or precedes ranges[{index - 1}] "
                        f"(end {previous.end}); ranges must be sorted and non-overlapping",
                        field="ranges",
                    )
            previous = rng

    def retention_at(self, token_index: int) -> tuple[int, int | None]:
        """(priority, duration_ms) for the block whose first token is ``token_index``."""
        for rng in self.ranges:
            if rng.contains(token_index):
                return rng.priority, rng.duration_ms
            if rng.start > token_index:
                break
        return DEFAULT_PRIORITY, None


DEFAULT_PLAN = RetentionPlan()
