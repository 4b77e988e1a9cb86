"""Routers: one interface for the gateway and the simulator; kv-aware plus three baselines.

Life cycle of a request, the same for every router (the caller supplies ``now``)::

    decision = router.route(request, candidates, now=now)      # the choice; no load bookkeeping
    router.on_dispatch(request, decision, now=now)             # sent: load, pending, approx index
    router.on_prefill_done(request.request_id, now=now)        # first token
    router.on_complete(request.request_id, now=now)            # finished, failed or cancelled
    router.apply_events(replica, pool_events, now=now)         # whenever a replica reports KV events

A retry after a failure before the first token is ``on_complete`` then ``route`` over the
remaining candidates and ``on_dispatch`` again. ``candidates`` are the pool's replicas that
are healthy and ``active`` (the caller filters: draining / disabled / broken replicas are
simply not passed).

* ``random``       — weighted random (``random.Random`` injected);
* ``round-robin``  — smooth weighted round-robin (nginx's: each turn every candidate gains
  its weight, the largest wins and pays the total);
* ``session``      — sticky: weighted rendezvous hashing of the session key (default the
  request's affinity key if it has one, else its first block hash, so one conversation — and one tenant's shared system
  prompt — lands on one replica while the replica set is stable);
* ``kv-aware``     — the cost of ``cost.py`` over per-replica indexes (``index.py``):
  precise where the replica sends KV events, approximate (what the router sent there)
  otherwise. SGLang's cache-aware router and AIBrix switch to pure load balancing when
  load is imbalanced (SGLang: shortest queue; AIBrix: load > mean + 2σ); here load is a
  term of the same cost, so the switch is continuous (``overlap_weight`` sets it), as in
  Dynamo, but measured above a band (``cost.py``). A request's affinity key
  (``prompt_cache_key``, ``affinity.py``) credits its home replica and breaks ties;
* ``kv-adaptive``  — kv-aware whose load band follows the measured imbalance (``tuning.py``).

Pure: no clock, no I/O; state is per router instance (one per pool in the gateway).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence

from retention.pool.events import KvEvent
from retention.routing.affinity import home_replica
from retention.routing.cost import CostModel, choose, rendezvous
from retention.routing.index import ApproximateIndex, BlockIndex, CapacityModel, PreciseIndex
from retention.routing.load import LoadTracker
from retention.routing.types import (
    NO_MATCH,
    Candidate,
    Decision,
    PrefixMatch,
    ReplicaId,
    ReplicaLoad,
    RouteRequest,
    RoutingError,
)



def session_key(request: RouteRequest) -> int | None:
    """The request's stickiness key: session key, else affinity key, else first block hash."""
    if request.session_key is not None:
        return request.session_key
    if request.affinity_key is not None:
        return request.affinity_key
    if request.hashes:
        return int(request.hashes[0])
    return None


class Router:
    """Base: in-flight load tracking shared by every router; subclasses implement ``_choose``."""

    name: str = "base"

    def __init__(
        self, *, tokens_per_block: int, rng: random.Random | None = None, half_life_s: float = 60.0
    ) -> None:
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
            raise RoutingError("tokens_per_block must be an integer >= 1")
        self.tokens_per_block = tokens_per_block
        self.rng = rng if rng is not None else random.Random(0)
        self.loads = LoadTracker(half_life_s=half_life_s)

    # ---------------------------------------------------------------- choice
    def route(self, request: RouteRequest, candidates: Sequence[Candidate], *, now: float) -> Decision:
        """Pick a replica among ``candidates`` (non-empty, distinct ids). Changes no load state."""
        if not candidates:
            raise RoutingError("no candidate replicas (none healthy and active)")
        ids = [c.replica for c in candidates]
        if len(set(ids)) != len(ids):
            raise RoutingError(f"duplicate candidate replicas: {ids}")
        return self._choose(request, candidates, now)

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        raise NotImplementedError

    def load(self, replica: ReplicaId, candidate: Candidate | None = None, *, now: float = 0.0) -> ReplicaLoad:
        """The load the router sees for ``replica`` (the candidate's own figures win)."""
        if candidate is not None and candidate.load is not None:
            return candidate.load
        return self.loads.load(replica, now=now)

    # ---------------------------------------------------------------- hooks
    def on_dispatch(self, request: RouteRequest, decision: Decision, *, now: float) -> None:
        """The request was sent to ``decision.replica``: count its load there."""
        bpt = self.tokens_per_block
        match = decision.match
        usable = max(0, (request.prompt_tokens - 1) // bpt)
        reused = min(match.blocks + match.pending_blocks, usable)
        self.loads.dispatch(
            request.request_id, decision.replica,
            prefill_tokens=request.prompt_tokens - reused * bpt,
            blocks=-(-(request.prompt_tokens + request.output_tokens) // bpt), now=now,
        )

    def on_prefill_done(self, request_id: Hashable, *, now: float) -> None:
        """The request produced its first token: its prefill no longer queues."""
        self.loads.prefill_done(request_id)

    def on_complete(self, request_id: Hashable, *, now: float) -> None:
        """The request ended (done, failed, cancelled). Idempotent."""
        self.loads.complete(request_id)

    def apply_events(
        self, replica: ReplicaId, events: Iterable[KvEvent], *, now: float, as_of: float | None = None
    ) -> None:
        """KV events reported by ``replica`` (ignored by routers without an index). ``as_of``
        (default ``now``): every event the replica emitted before that time is in this batch or
        an earlier one — for a poll, the time it was sent."""
        return None

    def forget_replica(self, replica: ReplicaId) -> None:
        """``replica`` failed or was removed: drop its in-flight load (and index)."""
        self.loads.forget_replica(replica)


class RandomRouter(Router):
    name = "random"

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        pick = self.rng.choices(list(candidates), weights=[c.weight for c in candidates])[0]
        return Decision(pick.replica, self.name)


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, *, tokens_per_block: int, rng: random.Random | None = None, half_life_s: float = 60.0) -> None:
        super().__init__(tokens_per_block=tokens_per_block, rng=rng, half_life_s=half_life_s)
        self._current: dict[ReplicaId, int] = {}

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        current = self._current
        total = 0
        for c in candidates:
            current[c.replica] = current.get(c.replica, 0) + c.weight
            total += c.weight
        best = max(candidates, key=lambda c: (current[c.replica], -c.replica))
        current[best.replica] -= total
        return Decision(best.replica, self.name)


class SessionRouter(Router):
    name = "session"

    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        key = session_key(request)
        if key is None:  # nothing to stick to (prompt shorter than a block): least running
            best = min(candidates, key=lambda c: (self.load(c.replica, c).running / c.weight, c.replica))
        else:
            best = max(candidates, key=lambda c: (rendezvous(key, c.replica, c.weight), -c.replica))
        return Decision(best.replica, self.name)


IndexFactory = Callable[[ReplicaId], BlockIndex]


class KvAwareRouter(Router):
    """Lowest expected prefill-after-reuse plus load (``cost.py``) over per-replica indexes.

    Indexes: ``index_factory(replica)`` builds a replica's index the first time it is a
    candidate (default: a :class:`PreciseIndex`); the first KV events a replica reports turn
    an approximate index into a precise one (the guess is dropped). ``on_dispatch`` records
    the prompt into approximate indexes and into the replica's *pending* set (blocks being
    computed there). A request that ends on a replica with a precise index keeps its pending
    blocks until the first event batch known to be complete past its end (``apply_events``'s
    ``as_of``): its prompt was stored at the end of its prefill, but the router learns that
    only from the replica's next report, and a follow-up turn routed in between must still
    see it there. ``on_complete`` clears them at once where no report is coming: a replica
    whose index is approximate (it already holds what was sent) or that has not reported yet
    (its first poll may find it sends no events at all).
    """

    name = "kv-aware"

    def __init__(
        self,
        *,
        tokens_per_block: int,
        cost: CostModel = CostModel(),
        index_factory: IndexFactory | None = None,
        rng: random.Random | None = None,
        half_life_s: float = 60.0,
    ) -> None:
        super().__init__(tokens_per_block=tokens_per_block, rng=rng, half_life_s=half_life_s)
        self.cost = cost
        self._factory: IndexFactory = index_factory or (lambda _replica: PreciseIndex())
        self._indexes: dict[ReplicaId, BlockIndex] = {}
        self._pending: dict[ReplicaId, dict[int, int]] = {}  # replica -> hash -> in-flight requests
        self._pending_of: dict[Hashable, tuple[ReplicaId, tuple[int, ...]]] = {}
        # replica -> (end time, prompt hashes) of ended requests whose blocks no report has covered yet
        self._settling: dict[ReplicaId, list[tuple[float, tuple[int, ...]]]] = {}
        self._reported: set[ReplicaId] = set()  # replicas whose event reports reach apply_events

    # ---------------------------------------------------------------- indexes
    def index(self, replica: ReplicaId) -> BlockIndex:
        """The replica's index (created on first use)."""
        index = self._indexes.get(replica)
        if index is None:
            index = self._indexes[replica] = self._factory(replica)
        return index

    def set_index(self, replica: ReplicaId, index: BlockIndex) -> None:
        self._indexes[replica] = index
        if not isinstance(index, PreciseIndex):  # no report will come to settle what ended there
            self._reported.discard(replica)
            for _, hashes in self._settling.pop(replica, ()):
                self._unpend(replica, hashes)

    def match(self, replica: ReplicaId, hashes: Sequence[int], *, now: float) -> PrefixMatch:
        """Held prefix on ``replica`` from its index, extended by blocks pending there."""
        held = self.index(replica).match(hashes, now=now)
        pending = self._pending.get(replica)
        if not pending:
            return held
        extra = 0
        for h in hashes[held.blocks :]:
            if h not in pending:
                break
            extra += 1
        return PrefixMatch(held.gpu_blocks, held.host_blocks, extra) if extra else held

    def apply_events(
        self, replica: ReplicaId, events: Iterable[KvEvent], *, now: float, as_of: float | None = None
    ) -> None:
        """Feed ``replica``'s KV events to its index; the first non-empty batch makes it precise.
        Even an empty batch settles the requests that ended there by ``as_of`` (default ``now``):
        whatever they stored is now in the index, or was evicted since."""
        events = list(events)
        self._reported.add(replica)
        if events:
            index = self._indexes.get(replica)
            if not isinstance(index, PreciseIndex):
                index = self._indexes[replica] = PreciseIndex()
            index.apply(events)
        settling = self._settling.get(replica)
        if settling:
            cutoff = now if as_of is None else as_of
            keep = [entry for entry in settling if entry[0] > cutoff]
            for ended, hashes in settling:
                if ended <= cutoff:
                    self._unpend(replica, hashes)
            self._settling[replica] = keep

    def forget_index(self, replica: ReplicaId) -> None:
        """Drop what the router believes ``replica`` holds (its index, pending and settling
        blocks), keeping its in-flight load: the replica may have restarted and lost its cache,
        but the requests still running there are released one by one by their ``on_complete``.
        The next use builds a fresh index from the factory."""
        self._indexes.pop(replica, None)
        self._pending.pop(replica, None)
        self._settling.pop(replica, None)
        self._reported.discard(replica)
        for rid in [rid for rid, (r, _) in self._pending_of.items() if r == replica]:
            del self._pending_of[rid]

    def forget_replica(self, replica: ReplicaId) -> None:
        super().forget_replica(replica)
        self.forget_index(replica)

    # ---------------------------------------------------------------- choice
    def _choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        return self._decide(request, candidates, now, self.cost)

    def _decide(self, request: RouteRequest, candidates: Sequence[Candidate], now: float, cost: CostModel) -> Decision:
        """The lowest ``cost`` among ``candidates`` (ties: rendezvous of the session key)."""
        bpt = self.tokens_per_block
        scores = cost.scores(
            [(c.replica, self.match(c.replica, request.hashes, now=now), self.load(c.replica, c, now=now), c.weight)
             for c in candidates],
            prompt_tokens=request.prompt_tokens, output_tokens=request.output_tokens, tokens_per_block=bpt,
            home=None if request.affinity_key is None else home_replica(request.affinity_key, candidates),
        )
        key = session_key(request)
        best = choose(
            scores, tie_key=0 if key is None else key, weights={c.replica: c.weight for c in candidates},
            temperature=cost.temperature, rng=self.rng,
        )
        return Decision(best.replica, self.name, best.match, scores)

    # ---------------------------------------------------------------- hooks
    def on_dispatch(self, request: RouteRequest, decision: Decision, *, now: float) -> None:
        super().on_dispatch(request, decision, now=now)
        replica = decision.replica
        hashes = tuple(int(h) for h in request.hashes)
        self.index(replica).record(hashes, now=now)
        pending = self._pending.setdefault(replica, {})
        for h in hashes:
            pending[h] = pending.get(h, 0) + 1
        self._pending_of[request.request_id] = (replica, hashes)

    def on_complete(self, request_id: Hashable, *, now: float) -> None:
        super().on_complete(request_id, now=now)
        entry = self._pending_of.pop(request_id, None)
        if entry is None:
            return
        replica, hashes = entry
        if replica in self._reported and isinstance(self._indexes.get(replica), PreciseIndex):
            self._settling.setdefault(replica, []).append((now, hashes))
        else:
            self._unpend(replica, hashes)

    def _unpend(self, replica: ReplicaId, hashes: tuple[int, ...]) -> None:
        pending = self._pending.get(replica)
        if pending is None:
            return
        for h in hashes:
            left = pending.get(h, 0) - 1
            if left > 0:
                pending[h] = left
            else:
                pending.pop(h, None)


def approximate_indexes(capacity: CapacityModel) -> IndexFactory:
    """An ``index_factory`` giving every replica an :class:`ApproximateIndex` of ``capacity``."""
    return lambda _replica: ApproximateIndex(capacity)


__all__ = [
    "NO_MATCH", "IndexFactory", "KvAwareRouter", "RandomRouter", "RoundRobinRouter", "Router",
    "SessionRouter", "approximate_indexes", "session_key",
]
