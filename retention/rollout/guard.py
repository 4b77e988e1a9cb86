"""The SLO guard: turn a pool's host tier off while its tail latency is over budget.

One :class:`SloGuard` per pool. The gateway feeds it one :class:`Observation` per
finished request (TTFT, mean inter-token latency, pilot arm) and calls :meth:`SloGuard.evaluate`
on a timer; nothing here reads a clock (pass ``now``, seconds on any monotonic origin).

Rules (``W`` = ``window_seconds``, ``N`` = ``min_requests``, ``h`` = ``hysteresis``):

* the *window* holds, for each latency (TTFT, ITL), the newest samples with ``at >= now - W``,
  at most ``max(max_observations, N)`` of them (memory is bounded whatever the traffic; above
  ``max_observations`` samples per ``W`` the p99 is that of the newest ones, so it covers less
  than ``W``). A request that measured no TTFT (not streamed) or no ITL takes no room. The
  registry bounds ``N`` by :data:`MAX_MIN_REQUESTS` (= ``DEFAULT_MAX_OBSERVATIONS``), so ``N``
  samples always fit;
* which requests enter the window: while not tripped, only the ``host`` arm's (planned with
  the host tier): the trip judges the tier, and a pilot's ``rollback`` arm runs without it.
  While tripped every request is planned ``rollback`` and all of them count;
* a budget (p99 TTFT, p99 ITL; ``None`` = not guarded) is *broken* at an evaluation
  when the window holds at least ``N`` samples of that latency and their p99
  (nearest rank) is above the budget;
* **trip**: every evaluation from some ``t0`` to ``now`` found a budget broken, and
  ``now - t0 >= W`` — the budget stayed broken for a whole window. One evaluation
  without a broken budget (too few samples counts as not broken) starts over;
* **restore**: tripped for at least ``cooldown_seconds``, and the window holds at least
  ``N`` samples of some guarded latency, and every guarded latency with ``N`` samples
  has p99 ``<= budget × (1 − h)`` (the hysteresis keeps it from flapping at the edge).
  Or at once by :meth:`SloGuard.restore` (an admin action), or when the guard is
  disabled by :meth:`SloGuard.configure`;
* the window is emptied on every transition: each state is judged on its own requests
  (after a trip, the slow requests that caused it would otherwise hold the restore back).

::

    p99 ▲          broken for W      cool-down          p99 <= budget·(1−h) with N samples
        │ budget ┄┄●━━━━━━━━━━━━━●┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄
        │                     trip ├───────────────┤ restore when healthy ●
        └──────────────────────────────────────────────────────────────────────► now
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_OBSERVATIONS = 4096  # samples kept per latency
# The largest ``min_requests`` the registry takes (tenants.slo, the admin API, the registry file):
# no more than the window keeps, or the guard could never trip.
MAX_MIN_REQUESTS = DEFAULT_MAX_OBSERVATIONS
ARM_HOST = "host"  # requests planned with the host tier
ARM_ROLLBACK = "rollback"  # requests planned below the offload threshold (guard tripped, or pilot control arm)


class GuardError(ValueError):
    """Invalid guard configuration; ``field`` names the offending setting."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _positive_or_none(value: float | None, field: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise GuardError(f"{field} must be a number > 0 or None, got {value!r}", field=field)


@dataclass(frozen=True, slots=True)
class SloBudget:
    """A pool's latency budget and guard settings (milliseconds for budgets, seconds for times).

    ``pilot_fraction``: the share of the pool's tenants that keep the host tier (1.0 = all:
    no pilot); the others are planned as if the guard were tripped.
    """

    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    window_seconds: float = 60.0
    min_requests: int = 20
    cooldown_seconds: float = 300.0
    hysteresis: float = 0.2
    enabled: bool = True
    pilot_fraction: float = 1.0

    def __post_init__(self) -> None:
        _positive_or_none(self.ttft_p99_ms, "ttft_p99_ms")
        _positive_or_none(self.itl_p99_ms, "itl_p99_ms")
        _positive_or_none(self.window_seconds, "window_seconds")
        if self.window_seconds is None:
            raise GuardError("window_seconds must be a number > 0", field="window_seconds")
        if isinstance(self.min_requests, bool) or not isinstance(self.min_requests, int) or self.min_requests < 1:
            raise GuardError(f"min_requests must be an integer >= 1, got {self.min_requests!r}", field="min_requests")
        if (isinstance(self.cooldown_seconds, bool) or not isinstance(self.cooldown_seconds, (int, float))
                or not math.isfinite(self.cooldown_seconds) or self.cooldown_seconds < 0):
            raise GuardError(f"cooldown_seconds must be a number >= 0, got {self.cooldown_seconds!r}",
                             field="cooldown_seconds")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, (int, float)) or not 0 <= self.hysteresis < 1:
            raise GuardError(f"hysteresis must be within [0, 1), got {self.hysteresis!r}", field="hysteresis")
        if not isinstance(self.enabled, bool):
            raise GuardError(f"enabled must be a boolean, got {self.enabled!r}", field="enabled")
        if (isinstance(self.pilot_fraction, bool) or not isinstance(self.pilot_fraction, (int, float))
                or not 0 <= self.pilot_fraction <= 1):
            raise GuardError(f"pilot_fraction must be within [0, 1], got {self.pilot_fraction!r}", field="pilot_fraction")

    @property
    def guarded(self) -> bool:
        """Whether the guard can trip at all (enabled, with at least one budget)."""
        return self.enabled and (self.ttft_p99_ms is not None or self.itl_p99_ms is not None)


@dataclass(frozen=True, slots=True)
class Observation:
    """One finished request: when, its TTFT and mean inter-token latency (seconds; ``None`` = not
    measured, e.g. a non-streamed request), its pilot arm and its cache outcome."""

    at: float
    ttft: float | None
    itl: float | None
    arm: str = ARM_HOST
    cache: str = "miss"  # gpu_hit | host_hit | miss (server.gateway.observe.metrics.cache_outcome)


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile (``None`` for no values): the smallest value with at least
    99 % of the values at or below it. With fewer than 100 values it is the maximum."""
    return percentile(values, 0.99)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """The window at one evaluation: sample counts and p99s (seconds)."""

    ttft_samples: int
    itl_samples: int
    ttft_p99: float | None
    itl_p99: float | None


@dataclass(frozen=True, slots=True)
class GuardTransition:
    """A state change: ``tripped`` is the new state; ``reason`` says why, for the audit log."""

    tripped: bool
    at: float
    reason: str
    window: WindowSummary


@dataclass(frozen=True, slots=True)
class GuardState:
    """What the admin API shows. Times are on the caller's clock."""

    tripped: bool
    since: float | None  # start of the current state (None: never changed)
    breach_since: float | None  # first of the unbroken run of evaluations with a broken budget
    last_reason: str
    trips: int
    restores: int
    window: WindowSummary


class SloGuard:
    """Trip/restore state machine of one pool (see the module docstring for the rules)."""

    __slots__ = ("_budget", "_max_observations", "_ttfts", "_itls", "_tripped", "_since", "_breach_since",
                 "_last_reason", "trips", "restores")

    def __init__(self, budget: SloBudget, *, max_observations: int = DEFAULT_MAX_OBSERVATIONS) -> None:
        if not isinstance(budget, SloBudget):
            raise GuardError("budget must be a SloBudget", field="budget")
        if isinstance(max_observations, bool) or not isinstance(max_observations, int) or max_observations < 1:
            raise GuardError("max_observations must be an integer >= 1", field="max_observations")
        self._budget = budget
        self._max_observations = max_observations
        # (at, seconds) per latency, in finishing order.
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=max(max_observations, budget.min_requests))
        self._itls: deque[tuple[float, float]] = deque(maxlen=max(max_observations, budget.min_requests))
        self._tripped = False
        self._since: float | None = None
        self._breach_since: float | None = None
        self._last_reason = ""
        self.trips = 0
        self.restores = 0

    @property
    def budget(self) -> SloBudget:
        return self._budget

    @property
    def tripped(self) -> bool:
        return self._tripped

    def configure(self, budget: SloBudget, now: float) -> GuardTransition | None:
        """Take new settings. Disabling (or removing every budget) restores a tripped guard at once;
        other changes apply from the next evaluation (a shorter window does not trip retroactively:
        the run of broken evaluations starts over)."""
        if not isinstance(budget, SloBudget):
            raise GuardError("budget must be a SloBudget", field="budget")
        if budget == self._budget:
            return None
        self._budget = budget
        keep = max(self._max_observations, budget.min_requests)
        if keep != self._ttfts.maxlen:  # the newest samples carry over
            self._ttfts = deque(self._ttfts, maxlen=keep)
            self._itls = deque(self._itls, maxlen=keep)
        self._breach_since = None
        if self._tripped and not budget.guarded:
            return self._transition(False, now, "guard disabled or budgets removed")
        return None

    def observe(self, observation: Observation) -> None:
        """Record a finished request (O(1); a latency's oldest sample goes when its window is full).
        Not tripped, only the ``host`` arm's requests count (see the module docstring)."""
        if not self._tripped and observation.arm != ARM_HOST:
            return
        if observation.ttft is not None:
            self._ttfts.append((observation.at, observation.ttft))
        if observation.itl is not None:
            self._itls.append((observation.at, observation.itl))

    def summary(self, now: float) -> WindowSummary:
        """The window's counts and p99s at ``now`` (drops samples older than the window)."""
        horizon = now - self._budget.window_seconds
        values = []
        for window in (self._ttfts, self._itls):
            while window and window[0][0] < horizon:
                window.popleft()
            # Why filter too: samples arrive in finishing order, which may be slightly out
            # of order in ``at``; popping stops at the first recent one.
            values.append([value for at, value in window if at >= horizon])
        ttfts, itls = values
        return WindowSummary(len(ttfts), len(itls), p99(ttfts), p99(itls))

    def _checks(self, summary: WindowSummary) -> list[tuple[str, int, float | None, float]]:
        """(name, samples, p99 seconds, budget seconds) of every guarded latency."""
        b = self._budget
        out = []
        if b.ttft_p99_ms is not None:
            out.append(("ttft", summary.ttft_samples, summary.ttft_p99, b.ttft_p99_ms / 1000))
        if b.itl_p99_ms is not None:
            out.append(("itl", summary.itl_samples, summary.itl_p99, b.itl_p99_ms / 1000))
        return out

    def evaluate(self, now: float) -> GuardTransition | None:
        """One evaluation at ``now``: returns the transition it made, if any."""
        summary = self.summary(now)
        b = self._budget
        if not b.guarded:
            self._breach_since = None
            return None
        checks = self._checks(summary)
        if not self._tripped:
            broken = [(name, n, value, budget) for name, n, value, budget in checks
                      if n >= b.min_requests and value is not None and value > budget]
            if not broken:
                self._breach_since = None
                return None
            if self._breach_since is None:
                self._breach_since = now
            if now - self._breach_since < b.window_seconds:
                return None
            detail = ", ".join(f"{name} p99 {value * 1000:.0f} ms > {budget * 1000:.0f} ms over {n} requests"
                               for name, n, value, budget in broken)
            return self._transition(True, now, f"budget broken for {b.window_seconds:g} s: {detail}", summary)
        if self._since is not None and now - self._since < b.cooldown_seconds:
            return None
        bar = 1 - b.hysteresis
        measured = [(name, n, value, budget) for name, n, value, budget in checks if n >= b.min_requests]
        if not measured or any(value is None or value > budget * bar for _, _, value, budget in measured):
            return None
        detail = ", ".join(f"{name} p99 {value * 1000:.0f} ms <= {budget * bar * 1000:.0f} ms over {n} requests"
                           for name, n, value, budget in measured)
        return self._transition(False, now, f"cool-down over and back under budget: {detail}", summary)

    def restore(self, now: float, reason: str = "restored by an admin") -> GuardTransition | None:
        """Restore the host tier at once (``None`` if the guard was not tripped)."""
        if not self._tripped:
            return None
        return self._transition(False, now, reason)

    def state(self, now: float) -> GuardState:
        return GuardState(self._tripped, self._since, self._breach_since, self._last_reason, self.trips,
                          self.restores, self.summary(now))

    def _transition(self, tripped: bool, now: float, reason: str, summary: WindowSummary | None = None) -> GuardTransition:
        summary = summary if summary is not None else self.summary(now)
        self._tripped = tripped
        self._since = now
        self._breach_since = None
        self._last_reason = reason
        self._ttfts.clear()
        self._itls.clear()
        if tripped:
            self.trips += 1
        else:
            self.restores += 1
        return GuardTransition(tripped, now, reason, summary)
