"""Per-tenant usage, counted in memory and written to the registry in batches.

Every flush is a batch with its own ``flush_id``; ``tenants.usage.record_usage`` applies
a batch at most once. A batch that fails to commit stays pending with the *same* id and
the *same* rows and is retried, so a retry after a crash or a lost commit acknowledgement
never double counts.

Without a journal, a hard crash (SIGKILL) loses the counts accumulated since the last
successful flush (at most the flush interval; while the registry is unreachable, everything
since it went away). With a :class:`UsageJournal`
(``server.gateway.usage_journal``, the default of ``kvgate serve``), every recorded
request is also appended to the open batch's segment file and :meth:`UsageRecorder.record`
returns an awaitable that completes once that line is fsynced; the batch is written to
the registry with the segment's flush id, and the segment is removed only after that
commit. A restarted gateway adopts the segments a dead one left and applies them with
their ids: nothing answered is lost, nothing is counted twice.

Invariants:

* a batch's flush id covers exactly the lines of its segment: the open batch and its segment
  grow together on the event loop and are sealed together (``_seal``, no await);
* a new batch is sealed only when no earlier one is pending (or only ones refused, below,
  which leave within ``QUARANTINE_AFTER`` flushes): while the registry is away the open batch
  (and its one segment) keeps growing instead, so the descriptors held stay bounded (one open
  segment, one sealed one, at most ``ADOPT_CHUNK`` adopted ones, adopted chunk by chunk as the
  earlier ones are applied, a few refused ones). An open batch was never sent, so growing it
  cannot break the at-most-once rule; a pending one never changes;
* only a transient failure (``TRANSIENT``: the connection, the server's state) stops a flush
  and keeps the batch for the next one. Any other failure is the batch's own (a value out of
  range, a bad flush id, an integrity error not about the flush id): the flush goes on with
  the later batches, and after ``QUARANTINE_AFTER`` such failures (one flush each) the batch's segment
  is moved to the journal's ``quarantine/`` (a journal-less batch is dropped), logged as an
  error and counted;
* a failed flush is logged (a warning at most every ``WARN_EVERY_S``) and counted; the backlog,
  the segments held and the counters are exported by :meth:`UsageRecorder.stats`
  (``kvgate_usage_*``, ``server.gateway.observe.metrics.UsageCollector``);
* after :meth:`UsageRecorder.close` a recorded request is neither journalled nor flushed, and
  says so (an error log), instead of being acknowledged as durable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, InternalError, OperationalError
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from server.gateway.usage_journal import Segment, UsageJournal, encode, new_flush_id
from tenants.usage import COUNTS, UsageRow, minute_bucket, record_usage

log = logging.getLogger("kvgate.gateway.usage")

# Failures of the registry rather than of the batch: retried with the same batch at the next
# flush. OperationalError, DisconnectionError, InterfaceError and the pool's timeout are the
# connection's; InternalError and ProgrammingError are the server's state (a read-only standby
# after a failover, a missing migration, a revoked grant), which would refuse every batch alike:
# quarantining them one by one would empty the journal for nothing.
TRANSIENT = (OperationalError, DisconnectionError, InterfaceError, PoolTimeout, InternalError, ProgrammingError,
             ConnectionError, TimeoutError)
QUARANTINE_AFTER = 3  # failures of a batch's own (one per flush at most) before its segment is quarantined
WARN_EVERY_S = 60.0  # at most one warning per this many seconds while flushes fail


def transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


@dataclass(slots=True)
class _Batch:
    flush_id: str
    rows: list[UsageRow]
    segment: Segment | None = None
    refusals: int = 0  # failures of its own (not transient) so far


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


class UsageRecorder:
    def __init__(self, session_factory: Callable[[], Session], *, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 journal: UsageJournal | None = None) -> None:
        self._sessions = session_factory
        self._clock = clock
        self._journal = journal
        self._open: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0] * len(COUNTS))
        self._segment: Segment | None = None  # the open batch's journal segment
        self._pending: list[_Batch] = []
        self._held: list[Segment] = []  # refused segments that could not be moved: kept locked until close
        self._flushing = asyncio.Lock()  # flush() runs alone (its docstring)
        self._closed = False
        self.replayed = 0  # journal segments adopted from a dead gateway (at start, then chunk by chunk)
        self.flush_failures = 0  # batch writes failed transiently (the batch kept)
        self.quarantined = 0  # batches refused for good (segment quarantined, or dropped without a journal)
        self.foreign_segments = 0  # segments of other registry fingerprints in the directory at start
        self._unreported = 0  # failures since the last warning
        self._last_warning = -math.inf
        if journal is not None:
            self._adopt()
            self.foreign_segments = journal.foreign_segments()
            if self.foreign_segments:
                log.warning("usage journal: %d segment(s) in %s belong to another registry fingerprint and are not "
                            "replayed by this gateway (another registry, or this one reached under another name)",
                            self.foreign_segments, journal.directory)

    def _adopt(self) -> int:
        """Adopt the next chunk of segments dead gateways left (if any may be left)."""
        if self._journal is None or not self._journal.orphans_left:
            return 0
        adopted = self._journal.adopt_orphans()
        for segment, rows in adopted:
            self._pending.append(_Batch(segment.flush_id, rows, segment))
        self.replayed += len(adopted)
        return len(adopted)

    def record(self, tenant_id: int, prompt_tokens: int, completion_tokens: int, cache_read_tokens: int = 0,
               cache_write_5m_tokens: int = 0, cache_write_1h_tokens: int = 0) -> Awaitable[None] | None:
        """Count one answered request; with a journal, the returned awaitable completes once it is durable.

        The cache counts are of its prompt tokens (``tenants.usage.UsageRow``): read from the KV
        cache, and kept under a client hint for 5 m / 1 h; together at most ``prompt_tokens``."""
        if self._closed:
            log.error("usage recorded after the recorder closed: neither journalled nor flushed "
                      "(tenant %s, %d prompt + %d completion tokens)", tenant_id, prompt_tokens, completion_tokens)
            return None
        minute = minute_bucket(self._clock())
        added = (1, prompt_tokens, completion_tokens, cache_read_tokens, cache_write_5m_tokens, cache_write_1h_tokens)
        counts = self._open[(tenant_id, minute)]
        for i, n in enumerate(added):
            counts[i] += n
        if self._journal is None:
            return None
        try:
            if self._segment is None:
                self._segment = self._journal.new_segment()
            written = self._journal.append(self._segment, encode(tenant_id, minute, *added[1:]))
        except OSError:
            log.exception("usage journal unavailable; this request's usage is counted in memory only")
            return None
        return self._durable(written)

    @staticmethod
    async def _durable(written: Awaitable[None]) -> None:
        # Why not raise: the answer is complete and its usage counted in memory (flushed as
        # before); a journal that cannot be written must not turn answers into errors.
        try:
            await written
        except OSError:
            log.error("usage journal write failed; this request's usage is counted in memory only")

    def _seal(self) -> None:
        # Why no await in here: counts and journal lines join the open batch on the event
        # loop thread, so sealing never splits one request between two batches.
        if self._open:
            rows = [UsageRow(t, m, *c) for (t, m), c in self._open.items()]
            self._open = defaultdict(lambda: [0] * len(COUNTS))
            segment, self._segment = self._segment, None
            self._pending.append(_Batch(segment.flush_id if segment is not None else new_flush_id(), rows, segment))

    def _write(self, flush_id: str, rows: list[UsageRow]) -> None:
        with self._sessions() as session:
            record_usage(session, flush_id=flush_id, rows=rows)

    async def flush(self) -> int:
        """Write the pending batches in order, then (once none is left) seal the open one and write it.

        Returns the rows written. Each batch is tried once per flush. A transient failure ends the
        flush (the batch and those after it are retried next time, with their ids); a batch's own
        failure does not (module docstring). Adopted segments are taken chunk by chunk as the
        earlier ones are applied.

        One flush at a time (``_flushing``): the start-up replay, the flush loop and the stop
        all call this, and a registry write can take seconds. A flush that comes while one is
        writing waits for it, then writes what is left; so a batch is written by one
        flush and dropped from the pending list (the very batch written, by identity) once."""
        async with self._flushing:
            written, sealed = 0, False
            tried: dict[int, _Batch] = {}  # by id; holding each batch keeps its id from being reused
            while True:
                if not self._pending:
                    self._adopt()
                if not sealed and all(b.refusals for b in self._pending):  # none pending but refused ones
                    self._seal()
                    sealed = True
                batches = [b for b in self._pending if id(b) not in tried]  # each batch once per flush
                if not batches:
                    return written
                tried.update((id(b), b) for b in batches)
                rows, stopped = await self._write_batches(batches)
                written += rows
                if stopped:  # the registry is away: the rest waits for the next flush
                    return written

    async def _write_batches(self, batches: list[_Batch]) -> tuple[int, bool]:
        """Each batch once, in order: (rows written, whether a transient failure stopped it)."""
        written = 0
        for batch in batches:
            try:
                await anyio.to_thread.run_sync(self._write, batch.flush_id, batch.rows)
            except Exception as exc:  # noqa: BLE001 - sorted below: the registry's, or the batch's own
                if transient(exc):
                    self._failed(exc)
                    return written, True
                self._refused(batch, exc)
                continue
            self._pending = [b for b in self._pending if b is not batch]
            if batch.segment is not None and self._journal is not None:
                self._journal.discard(batch.segment)  # in the registry now: the file may go
            written += len(batch.rows)
        if self._last_warning > -math.inf:
            log.info("usage flush: the registry takes batches again (%d failed flush(es) since the last warning)",
                     self._unreported)
            self._unreported, self._last_warning = 0, -math.inf
        return written, False

    def _failed(self, exc: BaseException) -> None:
        self.flush_failures += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            log.warning("usage flush failed %d time(s) (%s); %d row(s) wait in %d pending batch(es) and the open one, "
                        "kept with their flush ids", self._unreported, _first_line(exc), self.backlog,
                        len(self._pending))
            self._last_warning, self._unreported = now, 0

    def _refused(self, batch: _Batch, exc: BaseException) -> None:
        """A failure of the batch's own: tried again at the next flush, quarantined after QUARANTINE_AFTER in a row."""
        batch.refusals += 1
        if batch.refusals < QUARANTINE_AFTER:
            log.warning("usage batch %s refused by the registry (%s), try %d of %d; later batches go on",
                        batch.flush_id, _first_line(exc), batch.refusals, QUARANTINE_AFTER)
            return
        self._pending = [b for b in self._pending if b is not batch]
        self.quarantined += 1
        if batch.segment is None or self._journal is None:
            log.error("usage batch %s refused by the registry %d times (%s): dropped, %d row(s): %s", batch.flush_id,
                      batch.refusals, _first_line(exc), len(batch.rows), batch.rows[:5])
            return
        try:
            target = self._journal.quarantine(batch.segment)
        except OSError:
            log.exception("usage batch %s refused by the registry %d times (%s) and its segment %s could not be moved "
                          "to quarantine: kept locked until the gateway stops", batch.flush_id, batch.refusals,
                          _first_line(exc), batch.segment.path)
            self._held.append(batch.segment)
            return
        log.error("usage batch %s refused by the registry %d times (%s): its segment moved to %s (%d row(s)), "
                  "not replayed again", batch.flush_id, batch.refusals, _first_line(exc), target, len(batch.rows))

    def close(self) -> None:
        """Drop the journal's locks (after the last flush); unapplied segments stay for the next start.

        Nothing is recorded after this (``record`` logs the request as lost)."""
        self._closed = True
        if self._journal is not None:
            segments = [b.segment for b in self._pending if b.segment is not None] + self._held
            if self._segment is not None:
                segments.append(self._segment)
            self._segment = None
            self._held = []
            self._journal.close(segments)

    @property
    def backlog(self) -> int:
        return len(self._open) + sum(len(b.rows) for b in self._pending)

    def stats(self) -> dict[str, int]:
        """The figures exported as ``kvgate_usage_*`` (read at scrape time, from any thread)."""
        pending = list(self._pending)
        return {
            "backlog_rows": len(self._open) + sum(len(b.rows) for b in pending),
            "pending_batches": len(pending),
            "pending_segments": sum(1 for b in pending if b.segment is not None) + (self._segment is not None),
            "flush_failures": self.flush_failures,
            "quarantined_batches": self.quarantined,
            "unreadable_lines": self._journal.unreadable_lines if self._journal is not None else 0,
            "foreign_segments": self.foreign_segments,
        }
