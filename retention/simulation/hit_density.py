"""The hit-density ceiling: the most any *age-based* policy can hit on one tier of ``C`` blocks.

Belady (``retention/simulation/belady.py``) knows the future. An online policy knows, for an idle
block, only its past: here, how long ago it was last used. For blocks whose reuse gaps are
independent draws from one distribution (the generated chat families draw every think time
independently), that is all there is to know, and the best such policy holds each block
for some age ``D`` and then lets it go (possibly admitting only a share of them). Holding
for ``D`` turns ``F(D)`` of the idle periods into hits and costs ``E[min(gap, D)]``
block-seconds each, so with ``C`` blocks over a span ``S`` the hits are at most::

    max over D of  hits(D) × min(1, C·S / occupancy(D))

with ``hits(D)`` = idle periods ending in a reuse within ``D``, ``occupancy(D)`` = Σ
min(gap, D) (a period that never ends in a reuse counts until the trace ends). LRU is one
such policy (``D`` = its turnover), so it never exceeds the ceiling; ``protect`` is another
(admit a share, hold for a quantile of the gaps). Ranking by hit density is LHD's idea
(Beckmann et al., NSDI 2018).

Two classes of blocks, because one threshold for both would understate the ceiling:
**shared** blocks (a prefix that two different chains continue: system prompts,
documents) and **private** ones (a conversation's own history). Each class has its own
curve of (occupancy, hits) over ``D``; admitting a share of a class's blocks (or mixing two
hold times) reaches any point under the curve's upper concave hull, so the best split of
the tier between the classes is a fractional knapsack over the hulls' segments, steepest
(most hits per block-second) first. The space of the request being served is not
subtracted (an upper bound).

The budget is time-averaged (capacity × span). A request needs all its blocks resident at
its instant, which the average cannot see, so at capacities near the size of one request
the ceiling is loose and can exceed Belady's optimum; Belady bounds every policy, so
:meth:`AgeCeiling.capped` reports ``min(ceiling, Belady)``, still an upper bound for
age-based policies (what the simulator, ``kvgate analyze`` and the bench print).

The hulls depend on the trace only; :class:`AgeHulls` builds them once and answers any
capacity from them (one walk along the sorted segments).

The model is Belady's (one request at a time; full blocks cached after a request; the
first ``(len - 1) // B`` blocks matchable), except that a private block's hit does not
require its parent to be cached (an upper bound). The result is a ceiling for
policies that rank idle blocks by age and class alone, valid where gaps are i.i.d.
(the chat generators); on recorded traces it is an estimate, not a bound. Information
beyond age can pass it: the chat generators draw a session's length from {1, 2, 4, 8, 16}
turns, so a session at turn 3 surely has a fourth — an artifact no policy here reads.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from retention.simulation.belady import ChainRequest


IID_FAMILIES = frozenset({"chat", "chat-long"})  # generators that draw every think time independently

CeilingKind = Literal["bound", "estimate"]


def ceiling_kind(family: str | None) -> CeilingKind:
    """``"bound"`` where the ceiling's condition holds — the trace comes from a generated family
    whose reuse gaps are i.i.d. draws (``IID_FAMILIES``) —, else ``"estimate"``: any other family,
    and every trace whose origin is unknown (recorded traffic, a file), where a policy reading
    more than age (frequency, the conversation's turn) can pass it."""
    return "bound" if family in IID_FAMILIES else "estimate"


@dataclass(frozen=True, slots=True)
class AgeCeiling:
    capacity_blocks: int
    prompt_tokens: int
    shared_hit_tokens: float  # the bound's hits on shared blocks (fractional: a share admitted)
    private_hit_tokens: float  # the bound's hits on private blocks
    reusable_tokens: int  # reuses there are at all (what infinite capacity would hit)

    @property
    def hit_rate(self) -> float:
        total = self.shared_hit_tokens + self.private_hit_tokens
        return total / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def shared_hit_rate(self) -> float:
        return self.shared_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def capped(self, belady_hit_rate: float) -> float:
        """The hit rate to report: the ceiling, but never above Belady's at the same capacity
        (the time-averaged budget is loose near one request's size; Belady bounds every policy)."""
        return min(self.hit_rate, belady_hit_rate)


@dataclass(slots=True)
class IdlePeriods:
    """One class's idle periods: gaps that ended in a reuse, and the time left in the trace
    after the last caching of each block (the period that never ends in a reuse)."""

    gaps: list[float]
    never: list[float]


def shared_keys(requests: Sequence[ChainRequest]) -> set[int]:
    """Keys of blocks on a prefix that two different chains continue (fan-out ≥ 2 at or below).

    A key names its whole prefix, so a block with two different children is shared by
    every chain through it, and so is each of its ancestors."""
    child: dict[int, int] = {}
    branching: set[int] = set()
    for req in requests:
        for parent, key in zip(req.keys, req.keys[1:]):
            first = child.setdefault(parent, key)
            if first != key:
                branching.add(parent)
    shared: set[int] = set()
    for req in requests:
        deepest = max((i for i, key in enumerate(req.keys) if key in branching), default=-1)
        shared.update(req.keys[: deepest + 1])
    return shared


def idle_periods(requests: Sequence[ChainRequest], times_s: Sequence[float],
                 shared: set[int]) -> tuple[IdlePeriods, IdlePeriods]:
    """(shared, private) idle periods of every cached block."""
    if len(requests) != len(times_s):
        raise ValueError("one timestamp per request")
    if any(b < a for a, b in zip(times_s, times_s[1:])):
        raise ValueError("requests must be in timestamp order")
    cached_at: dict[int, float] = {}
    out = (IdlePeriods([], []), IdlePeriods([], []))
    for req, now in zip(requests, times_s):
        for key in req.keys[: req.matchable_blocks]:
            if key in cached_at:
                out[key not in shared].gaps.append(now - cached_at[key])
        for key in req.keys:  # full blocks are cached after the request: a new idle period starts
            cached_at[key] = now
    end = times_s[-1] if times_s else 0.0
    for key, t in cached_at.items():  # every block's last period never ends in a reuse
        out[key not in shared].never.append(end - t)
    return out


def hull(periods: IdlePeriods) -> list[tuple[float, float]]:
    """The upper concave hull of (occupancy, hits) over hold times, from (0, 0): its vertices.

    Holding every block for ``D`` = the k-th smallest gap gives k hits and occupancy
    Σ min(gap, D) + Σ min(never, D); between two gaps occupancy grows at constant hits, so
    the curve's vertices are at the gaps."""
    gaps = sorted(periods.gaps)
    never = sorted(periods.never)
    prefix_never = [0.0]
    for t in never:
        prefix_never.append(prefix_never[-1] + t)
    vertices: list[tuple[float, float]] = [(0.0, 0.0)]
    running = 0.0
    for k, g in enumerate(gaps, start=1):
        running += g
        m = bisect_right(never, g)
        point = (running + (len(gaps) - k) * g + prefix_never[m] + (len(never) - m) * g, float(k))
        while len(vertices) >= 2:  # drop a vertex that lies on or under the chord (upper hull)
            (x0, y0), (x1, y1) = vertices[-2], vertices[-1]
            if (y1 - y0) * (point[0] - x0) <= (point[1] - y0) * (x1 - x0):
                vertices.pop()
            else:
                break
        vertices.append(point)
    return vertices


Segment = tuple[float, float, float, int]  # (hits per block-second, block-seconds, hits, class)


def steepest_first(hulls: Sequence[Sequence[tuple[float, float]]]) -> list[Segment]:
    """Every hull's segments, most hits per block-second first (within a hull slopes only fall)."""
    segments: list[Segment] = []
    for c, vertices in enumerate(hulls):
        for (x0, y0), (x1, y1) in zip(vertices, vertices[1:]):
            if x1 > x0:
                segments.append(((y1 - y0) / (x1 - x0), x1 - x0, y1 - y0, c))
            else:  # hits at no occupancy (a gap of 0): free
                segments.append((float("inf"), 0.0, y1 - y0, c))
    segments.sort(key=lambda s: -s[0])
    return segments


def spend(segments: Sequence[Segment], classes: int, budget: float) -> list[float]:
    """Hits per class from spending ``budget`` block-seconds along ``segments`` in order."""
    hits = [0.0] * classes
    left = budget
    for _, width, height, c in segments:
        if width <= left:
            hits[c] += height
            left -= width
        else:
            hits[c] += height * left / width
            break
    return hits


def best_hits(hulls: Sequence[Sequence[tuple[float, float]]], budget: float) -> list[float]:
    """Hits per class from spending ``budget`` block-seconds on the steepest hull segments first."""
    return spend(steepest_first(hulls), len(hulls), budget)


@dataclass(frozen=True, slots=True)
class AgeHulls:
    """A trace's (shared, private) hull segments, steepest first, and what the ceiling needs
    besides the capacity: any capacity is then one walk along the segments."""

    segments: tuple[Segment, ...]
    span_s: float
    prompt_tokens: int
    reusable_blocks: int

    @classmethod
    def build(cls, requests: Sequence[ChainRequest], times_s: Sequence[float]) -> AgeHulls:
        """O(n log n) in idle periods; ``times_s`` per request, in order."""
        shared_periods, private_periods = idle_periods(requests, times_s, shared_keys(requests))
        return cls(
            segments=tuple(steepest_first([hull(shared_periods), hull(private_periods)])),
            span_s=(times_s[-1] - times_s[0]) if len(times_s) > 1 else 0.0,
            prompt_tokens=sum(r.prompt_tokens for r in requests),
            reusable_blocks=len(shared_periods.gaps) + len(private_periods.gaps),
        )

    def at(self, capacity_blocks: int, tokens_per_block: int) -> AgeCeiling:
        """The ceiling (module docstring) with ``capacity_blocks`` GPU blocks."""
        if capacity_blocks < 1 or tokens_per_block < 1:
            raise ValueError("capacity_blocks and tokens_per_block must be >= 1")
        shared_hits, private_hits = spend(self.segments, 2, capacity_blocks * self.span_s)
        return AgeCeiling(
            capacity_blocks=capacity_blocks,
            prompt_tokens=self.prompt_tokens,
            shared_hit_tokens=shared_hits * tokens_per_block,
            private_hit_tokens=private_hits * tokens_per_block,
            reusable_tokens=self.reusable_blocks * tokens_per_block,
        )


def age_ceiling(requests: Sequence[ChainRequest], times_s: Sequence[float], capacity_blocks: int,
                tokens_per_block: int) -> AgeCeiling:
    """The ceiling at one capacity (:class:`AgeHulls` answers several from one build)."""
    return AgeHulls.build(requests, times_s).at(capacity_blocks, tokens_per_block)
