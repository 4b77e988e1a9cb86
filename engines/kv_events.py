"""A replica's KV events in kvgate's block-hash space, readable by many pollers.

The gateway's router keeps, per replica, the set of block hashes the replica has cached
and in which tier (GPU or host). It learns them from the replica's *KV events*, polled
through the stats side channel (``engines/contract.py``): the stats request carries
``kv_events_since`` (a cursor) and the report carries a :class:`KvEventsReport`.

Hashes are kvgate's own chained, salted block hashes (``retention/hashing.py``), never an
engine's internal hash: the reference engine's pool hashes with that function already;
the Triton model translates TensorRT-LLM's events by hashing their tokens
(``engines/trtllm/kv_event_translator.py``).

Several gateways poll the same replica, so reading never consumes: the log is a bounded
ring of records with strictly increasing sequence numbers, and each poller keeps its own
cursor (the ``next_seq`` of its last report)::

    seq:   [ 41 42 43 ... 97 ]  next_seq = 98        ring keeps the newest `capacity`
    since=60  -> records 60..97, next_seq 98         (incremental)
    since=12  -> snapshot of every cached hash + next_seq 98   (12 fell off the ring)
    since=0   -> snapshot (first poll, or the poller lost track)

Invariants: sequence numbers start at 1 and never repeat within one ``epoch`` (a random
id fixed when the log is created, i.e. per engine start); a poller that applies either
the snapshot or every record with ``seq >= since`` in order holds exactly the replica's
cached set as of ``next_seq``. When the producer itself lost events (``invalidate``), every
cursor taken before that point gets a snapshot, and the ring starts over empty: the records it
holds always have consecutive sequence numbers, so an incremental report's records run from
``since`` to ``next_seq - 1`` without a hole (a poller may check exactly that).

A reader one version behind its engine (a record of a kind it does not know) cannot apply the
report: ``KvEventsReport.from_dict`` turns it into a *resync* report (no records, ``next_seq``
0), so the poller's next cursor asks for a snapshot instead of the stats answer failing.
"""

from __future__ import annotations

import secrets
from collections import deque
from itertools import islice
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from retention.pool.events import KvEvent, RemovedEvent, StoredEvent, UpdatedEvent

STORED = "stored"  # blocks became cached in `tier` (GPU = 0, host = 1)
REMOVED = "removed"  # blocks left the cache (both tiers)
MOVED = "moved"  # cached blocks moved to `tier` (offload GPU -> host, onboard host -> GPU)
KINDS = (STORED, REMOVED, MOVED)

GPU, HOST = 0, 1


@dataclass(frozen=True, slots=True)
class KvEventRecord:
    seq: int
    kind: str  # STORED | REMOVED | MOVED
    hashes: tuple[int, ...]
    tier: int = GPU  # for STORED / MOVED: the tier the blocks are now in

    def to_list(self) -> list:
        return [self.seq, self.kind, list(self.hashes), self.tier]

    @classmethod
    def from_list(cls, item: list) -> KvEventRecord:
        seq, kind, hashes, tier = item
        if kind not in KINDS:
            raise ValueError(f"unknown KV event kind {kind!r}")
        return cls(int(seq), kind, tuple(int(h) for h in hashes), int(tier))


@dataclass(slots=True)
class KvEventsReport:
    """One poll's answer. ``snapshot`` (hash -> tier) is set iff the poller must resync.

    ``next_seq`` is the cursor for the next poll. ``supported`` is False for replicas that
    cannot report events (TensorRT-LLM orchestrator mode): the router then indexes what
    it sent there (approximate mode). ``resync`` is set by the reader only (:meth:`from_dict`,
    never sent): the report held a record this reader cannot apply, so it carries no records
    and ``next_seq`` 0, and the poller must ask for a snapshot.
    """

    epoch: str
    next_seq: int
    events: list[KvEventRecord] = field(default_factory=list)
    snapshot: dict[int, int] | None = None
    supported: bool = True
    resync: bool = False
    unknown_kinds: tuple[str, ...] = ()  # with ``resync``: the kinds this reader did not know (the poller logs them)

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch, "next_seq": self.next_seq, "supported": self.supported,
            "events": [e.to_list() for e in self.events],
            "snapshot": None if self.snapshot is None else [[h, t] for h, t in self.snapshot.items()],
        }

    @classmethod
    def from_dict(cls, data: dict) -> KvEventsReport:
        """The report as sent; one holding a record of an unknown kind (a newer engine's) comes
        back as a resync report (no records, ``next_seq`` 0, ``resync`` set)."""
        snapshot = data.get("snapshot")
        epoch, supported = str(data["epoch"]), bool(data.get("supported", True))
        items = data.get("events") or ()
        unknown = sorted({str(item[1]) for item in items if item[1] not in KINDS})
        if unknown:
            return cls(epoch=epoch, next_seq=0, supported=supported, resync=True, unknown_kinds=tuple(unknown))
        return cls(
            epoch=epoch, next_seq=int(data["next_seq"]), supported=supported,
            events=[KvEventRecord.from_list(e) for e in items],
            snapshot=None if snapshot is None else {int(h): int(t) for h, t in snapshot},
        )

    @classmethod
    def unsupported(cls) -> KvEventsReport:
        return cls(epoch="", next_seq=0, supported=False)


def apply_report(cached: dict[int, int], report: KvEventsReport) -> None:
    """Fold one report into a poller's mirror ``cached`` (hash -> tier), in place."""
    if report.snapshot is not None:
        cached.clear()
        cached.update(report.snapshot)
    for event in report.events:
        if event.kind == STORED:
            for h in event.hashes:
                cached[h] = event.tier
        elif event.kind == REMOVED:
            for h in event.hashes:
                cached.pop(h, None)
        else:  # MOVED: only blocks the mirror knows (a move of an unknown block is stale)
            for h in event.hashes:
                if h in cached:
                    cached[h] = event.tier


class KvEventLog:
    """The bounded, non-destructive event ring of one replica (see module docstring).

    Not thread-safe: the engine calls it under its own lock. ``snapshot`` returns the
    replica's cached blocks (hash -> tier) at the moment of the call, consistent with
    every record appended so far.
    """

    def __init__(self, snapshot: Callable[[], dict[int, int]], *, capacity: int = 65_536,
                 epoch: str | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._snapshot = snapshot
        self._ring: deque[KvEventRecord] = deque(maxlen=capacity)
        self._next_seq = 1
        self._valid_from = 1  # cursors below this get a snapshot (set by invalidate)
        self.epoch = epoch or secrets.token_hex(8)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def append(self, kind: str, hashes: Iterable[int], tier: int = GPU) -> None:
        hashes = tuple(int(h) for h in hashes)
        if not hashes:
            return
        if kind not in KINDS:
            raise ValueError(f"unknown KV event kind {kind!r}")
        self._ring.append(KvEventRecord(self._next_seq, kind, hashes, tier))
        self._next_seq += 1

    def invalidate(self) -> None:
        """The producer lost events (its own buffer overflowed): every poller resyncs.

        The lost events would have taken the next sequence number, so it is skipped: every
        cursor taken so far is now below ``valid_from``, and a snapshot taken after this
        call comes with a cursor that is valid. The ring is emptied: no cursor can read its
        records any more, and keeping them would leave a hole in the ring's sequence numbers
        (``report`` finds a cursor's first record by its distance from the oldest one).
        """
        self._ring.clear()
        self._next_seq += 1
        self._valid_from = self._next_seq

    def report(self, since: int) -> KvEventsReport:
        """Records with ``seq >= since``, or a snapshot when they are not all held."""
        oldest = self._ring[0].seq if self._ring else self._next_seq
        if since < max(oldest, self._valid_from, 1) or since > self._next_seq:
            return self._snapshot_report()
        events = list(islice(self._ring, since - oldest, None))
        if events and events[0].seq != since:  # a hole in the ring (never, see invalidate): resync
            return self._snapshot_report()
        return KvEventsReport(self.epoch, self._next_seq, events)

    def _snapshot_report(self) -> KvEventsReport:
        return KvEventsReport(self.epoch, self._next_seq, snapshot=dict(self._snapshot()))


class PoolEventFeed:
    """Translates a ``retention`` pool's drained events into a :class:`KvEventLog`.

    The pool's events are already in kvgate's hash space (``retention/pool.py`` hashes
    with ``retention/hashing.py``), so translation is only a change of shape: stored
    blocks grouped by tier, removed hashes, tier changes (offload / onboard) as moves.
    Priority-only updates do not change what is cached and are not reported. A gap in
    the pool's event ids (its bounded buffer overflowed) invalidates the log.
    """

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        self._last_event_id: int | None = None

    def feed(self, events: Iterable[KvEvent]) -> None:
        for event in events:
            event_id = event.event_id
            if self._last_event_id is not None and event_id != self._last_event_id + 1:
                self.log.invalidate()
            self._last_event_id = event_id
            if isinstance(event, StoredEvent):
                by_tier: dict[int, list[int]] = {}
                for block in event.blocks:
                    by_tier.setdefault(int(block.cache_level), []).append(block.block_hash)
                for tier, hashes in by_tier.items():
                    self.log.append(STORED, hashes, tier)
            elif isinstance(event, RemovedEvent):
                self.log.append(REMOVED, event.block_hashes)
            elif isinstance(event, UpdatedEvent) and event.cache_level is not None:
                self.log.append(MOVED, (event.block_hash,), int(event.cache_level[1]))
