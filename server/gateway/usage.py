"""Per-tenant usage, counted in memory and written to the registry in batches.

Every flush is a batch with its own ``flush_id``; ``tenants.usage.record_usage`` applies
a batch at most once. A batch that fails to commit stays pending with the *same* id and
is retried, so a retry after a crash or a lost commit acknowledgement never double
counts.

Without a journal, a hard crash (SIGKILL) loses the counts accumulated since the last
successful flush (at most the flush interval). With a :class:`UsageJournal`
(``server.gateway.usage_journal``, the default of ``kvgate serve``), every recorded
request is also appended to the open batch's segment file and :meth:`UsageRecorder.record`
returns an awaitable that completes once that line is fsynced; the batch is written to
the registry with the segment's flush id, and the segment is removed only after that
commit. A restarted gateway adopts the segments a dead one left and applies them with
their ids: nothing answered is lost, nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from server.gateway.usage_journal import Segment, UsageJournal, encode, new_flush_id
from tenants.usage import UsageRow, minute_bucket, record_usage

log = logging.getLogger("kvgate.gateway.usage")


@dataclass(slots=True)
class _Batch:
    flush_id: str
    rows: list[UsageRow]
    segment: Segment | None = None


class UsageRecorder:
    def __init__(self, session_factory: Callable[[], Session], *, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 journal: UsageJournal | None = None) -> None:
        self._sessions = session_factory
        self._clock = clock
        self._journal = journal
        self._open: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._segment: Segment | None = None  # the open batch's journal segment
        self._pending: list[_Batch] = []
        self._flushing = asyncio.Lock()  # flush() runs alone (its docstring)
        self.replayed = 0  # journal segments adopted from a dead gateway at start
        if journal is not None:
            for segment, rows in journal.adopt_orphans():
                self._pending.append(_Batch(segment.flush_id, rows, segment))
                self.replayed += 1

    def record(self, tenant_id: int, prompt_tokens: int, completion_tokens: int) -> Awaitable[None] | None:
        """Count one answered request; with a journal, the returned awaitable completes once it is durable."""
        minute = minute_bucket(self._clock())
        counts = self._open[(tenant_id, minute)]
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens
        if self._journal is None:
            return None
        try:
            if self._segment is None:
                self._segment = self._journal.new_segment()
            written = self._journal.append(self._segment, encode(tenant_id, minute, prompt_tokens, completion_tokens))
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
            self._open = defaultdict(lambda: [0, 0, 0])
            segment, self._segment = self._segment, None
            self._pending.append(_Batch(segment.flush_id if segment is not None else new_flush_id(), rows, segment))

    def _write(self, flush_id: str, rows: list[UsageRow]) -> None:
        with self._sessions() as session:
            record_usage(session, flush_id=flush_id, rows=rows)

    async def flush(self) -> int:
        """Write every sealed batch in order; stops at the first failure (retried next time).

        One flush at a time (``_flushing``): the start-up replay, the flush loop and the stop
        all call this, and a registry write can take seconds. A flush that comes while one is
        writing waits for it, then seals and writes what is left; so a batch is written by one
        flush and dropped from the pending list (the very batch written, by identity) once."""
        async with self._flushing:
            self._seal()
            written = 0
            while self._pending:
                batch = self._pending[0]
                try:
                    await anyio.to_thread.run_sync(self._write, batch.flush_id, batch.rows)
                except SQLAlchemyError:
                    break
                self._pending = [b for b in self._pending if b is not batch]
                if batch.segment is not None and self._journal is not None:
                    self._journal.discard(batch.segment)  # in the registry now: the file may go
                written += len(batch.rows)
            return written

    def close(self) -> None:
        """Drop the journal's locks (after the last flush); unapplied segments stay for the next start."""
        if self._journal is not None:
            segments = [b.segment for b in self._pending if b.segment is not None]
            if self._segment is not None:
                segments.append(self._segment)
            self._journal.close(segments)

    @property
    def backlog(self) -> int:
        return len(self._open) + sum(len(b.rows) for b in self._pending)
