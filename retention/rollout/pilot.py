"""Pilot mode: the host tier for a stable fraction of a pool's tenants, both arms compared.

:func:`pilot_arm` splits tenants by a hash of their id: the tenant's point
``u = sha256(id)[:8] / 2**64`` in ``[0, 1)`` puts it in the ``host`` arm when
``u < fraction``, else in the ``rollback`` arm (planned below the offload threshold, as
if the guard were tripped). The split is stable (no state, same answer in every gateway
process and after restarts) and monotone: raising the fraction only moves tenants from
``rollback`` to ``host``. The guard (:mod:`retention.rollout.guard`) judges a trip on the
``host`` arm alone: the ``rollback`` arm runs without the tier, so its latency says nothing
about it (a slow rollback arm never takes the tier from the pilot tenants).

:class:`PilotReport` keeps a bounded window of observations and summarises each arm's
latency and *hit quality* (GPU hits, host hits, misses that recompute) side by side.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

from retention.rollout.guard import (
    ARM_HOST,
    ARM_ROLLBACK,
    DEFAULT_MAX_OBSERVATIONS,
    GuardError,
    Observation,
    percentile,
)

ARMS = (ARM_HOST, ARM_ROLLBACK)


def pilot_point(tenant_key: str) -> float:
    """The tenant's fixed point in ``[0, 1)``."""
    digest = hashlib.sha256(tenant_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pilot_arm(tenant_key: str, fraction: float) -> str:
    """``"host"`` or ``"rollback"`` for this tenant at this pilot fraction (1.0 = everyone ``host``)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise GuardError(f"pilot fraction must be within [0, 1], got {fraction!r}", field="pilot_fraction")
    if fraction >= 1:
        return ARM_HOST
    return ARM_HOST if pilot_point(tenant_key) < fraction else ARM_ROLLBACK


@dataclass(frozen=True, slots=True)
class ArmSummary:
    """One arm over the window: requests, latency percentiles (seconds), cache outcomes."""

    requests: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p99: float | None
    gpu_hits: int
    host_hits: int
    misses: int

    @property
    def hit_ratio(self) -> float | None:
        """Share of requests that reused any cached prefix (GPU or host)."""
        return None if not self.requests else (self.gpu_hits + self.host_hits) / self.requests


class PilotReport:
    """Both arms over the last ``window_seconds`` (at most ``max_observations`` kept)."""

    __slots__ = ("window_seconds", "_window")

    def __init__(self, window_seconds: float, *, max_observations: int = DEFAULT_MAX_OBSERVATIONS) -> None:
        if isinstance(window_seconds, bool) or not isinstance(window_seconds, (int, float)) or window_seconds <= 0:
            raise GuardError("window_seconds must be a number > 0", field="window_seconds")
        self.window_seconds = window_seconds
        self._window: deque[Observation] = deque(maxlen=max_observations)

    def observe(self, observation: Observation) -> None:
        self._window.append(observation)

    def summary(self, now: float) -> dict[str, ArmSummary]:
        horizon = now - self.window_seconds
        while self._window and self._window[0].at < horizon:
            self._window.popleft()
        out = {}
        for arm in ARMS:
            rows = [o for o in self._window if o.arm == arm and o.at >= horizon]
            ttfts = [o.ttft for o in rows if o.ttft is not None]
            itls = [o.itl for o in rows if o.itl is not None]
            out[arm] = ArmSummary(
                requests=len(rows), ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99),
                itl_p99=percentile(itls, 0.99), gpu_hits=sum(o.cache == "gpu_hit" for o in rows),
                host_hits=sum(o.cache == "host_hit" for o in rows), misses=sum(o.cache == "miss" for o in rows),
            )
        return out
