"""In-flight load per replica, tracked by the router from its own hooks.

Dynamo's KV router keeps the same two numbers per worker (``docs/design_docs/router_design.md``:
*potential prefill blocks* — tokens still to prefill — and *active blocks* of running
sequences), updating prefill when the first output token arrives and active blocks when a
request completes. kvgate's hooks::

    on_dispatch ──► queued prefill += predicted new tokens, active += blocks, running += 1,
                    recent prefill (decayed, half-life ``half_life_s``) += predicted new tokens
    on_prefill_done (first token) ──► queued prefill -= that request's share
    on_complete (done, failed or cancelled) ──► everything of the request removed

Invariant: queued prefill, active blocks and running equal the sums over the replica's
in-flight requests, so they are never negative and return to zero when the replica has
nothing in flight. Recent prefill only decays (it is history, not in-flight state).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from retention.routing.types import ReplicaId, ReplicaLoad, RoutingError


@dataclass(slots=True)
class _InFlight:
    replica: ReplicaId
    prefill_tokens: int
    blocks: int
    prefilling: bool = True


@dataclass(slots=True)
class _Totals:
    queued_prefill_tokens: int = 0
    active_blocks: int = 0
    running: int = 0
    recent_prefill: float = 0.0  # decayed sum of dispatched prefill tokens, as of ``recent_at``
    recent_at: float = 0.0


class LoadTracker:
    """Requests in flight per replica; see the module docstring for the life cycle."""

    __slots__ = ("_requests", "_totals", "half_life_s")

    def __init__(self, *, half_life_s: float = 60.0) -> None:
        if not half_life_s > 0:
            raise RoutingError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._requests: dict[Hashable, _InFlight] = {}
        self._totals: dict[ReplicaId, _Totals] = {}

    def _decayed(self, t: _Totals, now: float) -> float:
        if now <= t.recent_at:
            return t.recent_prefill
        return t.recent_prefill * 0.5 ** ((now - t.recent_at) / self.half_life_s)

    def load(self, replica: ReplicaId, *, now: float = 0.0) -> ReplicaLoad:
        t = self._totals.get(replica)
        if t is None:
            return ReplicaLoad()
        return ReplicaLoad(t.queued_prefill_tokens, t.active_blocks, t.running, self._decayed(t, now))

    def replica_of(self, request_id: Hashable) -> ReplicaId | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry.replica

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def dispatch(
        self, request_id: Hashable, replica: ReplicaId, *, prefill_tokens: int, blocks: int, now: float = 0.0
    ) -> None:
        if request_id in self._requests:
            raise RoutingError(f"request {request_id!r} is already in flight")
        self._requests[request_id] = _InFlight(replica, max(0, prefill_tokens), max(0, blocks))
        t = self._totals.setdefault(replica, _Totals())
        t.recent_prefill = self._decayed(t, now) + max(0, prefill_tokens)
        t.recent_at = max(now, t.recent_at)
        t.queued_prefill_tokens += max(0, prefill_tokens)
        t.active_blocks += max(0, blocks)
        t.running += 1

    def prefill_done(self, request_id: Hashable) -> None:
        """The request produced its first token (idempotent; unknown ids are ignored)."""
        entry = self._requests.get(request_id)
        if entry is None or not entry.prefilling:
            return
        entry.prefilling = False
        self._totals[entry.replica].queued_prefill_tokens -= entry.prefill_tokens

    def complete(self, request_id: Hashable) -> ReplicaId | None:
        """Remove the request (idempotent); returns the replica it ran on, or None."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        t = self._totals[entry.replica]
        if entry.prefilling:
            t.queued_prefill_tokens -= entry.prefill_tokens
        t.active_blocks -= entry.blocks
        t.running -= 1
        return entry.replica

    def forget_replica(self, replica: ReplicaId) -> list[Hashable]:
        """Drop every request of ``replica`` (it failed); returns their ids."""
        gone = [rid for rid, e in self._requests.items() if e.replica == replica]
        for rid in gone:
            self.complete(rid)
        self._totals.pop(replica, None)
        return gone
