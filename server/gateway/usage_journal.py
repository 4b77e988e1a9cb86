"""An append-only local journal of answered requests' usage, fsynced by default (survives SIGKILL).

Layout: one *segment* file per usage batch, ``<dir>/usage-<registry>-<flush_id>.jsonl``
(``registry``: a fingerprint of the registry database, so gateways of different registries
sharing a directory never replay each other's segments), one JSON line
per answered request (``{"t": tenant_id, "m": unix minute, "p": prompt, "c": completion}``).
The segment's file name carries the ``flush_id`` its batch is written to the registry with
(``tenants.usage.record_usage``, applied at most once), so replaying a segment after a
crash can never double count: a batch the dead gateway already committed is refused by its
id, one it had not is applied once.

Invariants:

* a segment is *owned* by the process holding an exclusive ``flock`` on it, from its
  creation (or adoption at start) until it is applied and unlinked; a gateway adopts only
  segments whose lock it can take, i.e. whose owner died. Several gateways may therefore
  share one directory (a restarted pod replays what a dead one left), and a live
  segment is never replayed behind its owner's back;
* :meth:`UsageJournal.append` returns once the line is on disk (``write`` + ``fsync``;
  a new segment also fsyncs the directory so its name survives). Appends are group
  committed: every line that arrives while one ``fsync`` runs goes into the next one, so
  the cost is one ``fsync`` per group, not per request. With ``fsync=False``
  (``KVGATE_USAGE_JOURNAL_SYNC=write``) it returns once the line is written, with no ``fsync``
  of the segment or of the directory (below);
* a torn or unreadable line (a write the kill interrupted, whose group therefore never
  completed and whose request was not acknowledged as recorded) is skipped at replay.

What it costs, and why the ``fsync`` stays before the answer. At one client the journal costs
1.12 × (JSON) and 1.19 × (streamed) the gateway CPU per request of a gateway without it
(``bench/server/usage_journal.py``, docs/benchmarks.md ``bench:usage_journal``; 1.11 × and 1.09 × in
another run). Timed inside the gateway, a group's ``fsync`` takes 0.14 ms of CPU (0.41 ms of wall
time) and its ``write`` 0.03 ms, less than that difference (0.3–0.9 ms); the rest was not traced
to any one frame. Measured against this code in alternating rounds at one client (gateway CPU per
request, JSON / streamed): the same ``write`` and ``fsync`` on the event loop instead of the
writer thread cost the same (1.00 × / 1.01 ×), so the
hand-off is not the cost; a segment preallocated with zeros and synced with ``fdatasync`` (no
metadata to commit) saved 1 % / 3 %, within the noise; a ``write`` alone on the loop, with no
``fsync``, costs 1.02 × / 1.04 × no journal at all. Answering after the ``write`` and syncing
after the answer would survive SIGKILL but not a power loss or a kernel crash, and the point of
the journal is that an answered request's usage is on disk: so the default
(``KVGATE_USAGE_JOURNAL_SYNC=fsync``) keeps the ``fsync`` before the answer.

``KVGATE_USAGE_JOURNAL_SYNC=write`` (``fsync=False``) is the operator's trade, as PostgreSQL's
``synchronous_commit = off``: the line is written (into the kernel's page cache) before the
answer and the journal never fsyncs. A SIGKILL or any other crash of the process loses nothing,
since the kernel still holds the lines. A power loss or a kernel crash loses the lines the
kernel had not yet written back of batches not yet in the registry: normally about the last
flush interval's usage (an applied batch's segment is removed), while the registry is
unreachable up to the kernel's writeback delay (Linux's default about 30 s,
``vm.dirty_expire_centisecs``). A new segment's directory entry is not fsynced either: its name
made durable without its lines would save nothing, and the kernel writes the name back on its
own as it does the lines. A line the power loss tore or left as zeros is skipped at replay as a
torn line is, and a segment whose batch was applied but whose removal was lost is refused by its
flush id. The nearest measured cost is the ``write`` alone above (1.02 × / 1.04 ×); this mode
itself (the ``write`` on the writer thread) was not benchmarked.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import make_url

from tenants.usage import UsageRow

log = logging.getLogger("kvgate.gateway.usage")
PREFIX, SUFFIX = "usage-", ".jsonl"


def registry_fingerprint(database_url: str) -> str:
    """Names one registry whatever the credentials: dialect, host, port, database (SQLite: the file), options."""
    url = make_url(database_url)
    database = url.database or ""
    if url.get_backend_name() == "sqlite" and database and database != ":memory:":
        database = str(Path(database).resolve())
    query = sorted((k, str(v)) for k, v in url.query.items())  # e.g. a search_path option: another schema
    ident = f"{url.get_backend_name()}|{url.host or ''}|{url.port or ''}|{database}|{query}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def new_flush_id() -> str:
    return f"gw-{secrets.token_hex(12)}"


@dataclass(slots=True, eq=False)
class Segment:
    """One batch's file: its flush id, its locked descriptor, lines not yet on disk."""

    flush_id: str
    path: Path
    fd: int
    synced_dir: bool = False
    buffer: list[bytes] = field(default_factory=list)
    writing: bool = False  # a group commit is writing this segment's lines now
    discarded: bool = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1


def encode(tenant_id: int, minute: datetime, prompt_tokens: int, completion_tokens: int) -> bytes:
    m = int(minute.timestamp()) // 60
    return json.dumps({"t": tenant_id, "m": m, "p": prompt_tokens, "c": completion_tokens},
                      separators=(",", ":")).encode() + b"\n"


def decode(data: bytes) -> list[UsageRow]:
    """The rows of a segment's bytes; lines that are not complete, valid records are skipped."""
    rows = []
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: empty, or a line the kill tore
    for line in lines:
        if not line:
            continue
        try:
            r = json.loads(line)
            row = UsageRow(int(r["t"]), datetime.fromtimestamp(int(r["m"]) * 60, UTC), 1, int(r["p"]), int(r["c"]))
        except (ValueError, KeyError, TypeError):
            log.warning("usage journal: skipped an unreadable line")
            continue
        if row.prompt_tokens < 0 or row.completion_tokens < 0:
            continue
        rows.append(row)
    return rows


class _Writer:
    """One daemon thread running the journal's group commits back to back.

    The event loop hands it work only when it is idle (:meth:`wake`); while it writes, new
    lines queue in the journal's buffers and it takes them as the next group itself, without
    a round trip through the loop. Each group's waiters are completed with one
    ``call_soon_threadsafe`` per loop.

    Why a thread of its own rather than ``anyio.to_thread.run_sync``: anyio's hand-off
    (capacity limiter, a ``queue.Queue`` whose ``Condition`` is Python code, worker
    bookkeeping) costs ~3 × the CPU of a C ``SimpleQueue`` and ``call_soon_threadsafe``.
    Why the thread drains the buffers itself rather than a commit task on the loop per
    group: per request at one client that task, its shielded future and their wake-ups
    were a third of the journal's CPU on the loop (docs/benchmarks.md
    ``bench:gateway_profile``). The thread starts on first use and again if it ever died; it
    blocks in ``SimpleQueue.get`` (no GIL held) while idle.
    """

    __slots__ = ("_jobs", "_thread")

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wake(self, drain: Callable[[], None]) -> None:
        """Run ``drain()`` on the thread (it returns once nothing is left to write)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="usage-journal", daemon=True)
            self._thread.start()
        self._jobs.put(drain)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
        self._thread = None

    def _run(self) -> None:
        while (drain := self._jobs.get()) is not None:
            drain()


def _complete(waiters: list[asyncio.Future], error: BaseException | None) -> None:
    """On the waiters' loop: the group's outcome to every waiter still waiting."""
    for waiter in waiters:
        if not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(OSError(f"usage journal write failed: {error!r}"))


class UsageJournal:
    """Segments under ``directory``; see the module docstring for the invariants."""

    def __init__(self, directory: Path, *, registry: str, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self._prefix = f"{PREFIX}{registry}-"
        self._fsync = fsync
        self._writer = _Writer()
        # Shared by the loop (append, discard, close) and the writer thread (drain): the
        # buffers, the waiters, whether the thread is draining, segments' writing flags.
        self._lock = threading.Lock()
        self._draining = False
        self._waiters: list[asyncio.Future] = []
        self._dirty: list[Segment] = []  # segments with buffered lines, in first-append order
        self.fsyncs = 0  # group commits done (for the benchmark)

    # Start: adopt what dead gateways left ----------------------------------------------------
    def adopt_orphans(self) -> list[tuple[Segment, list[UsageRow]]]:
        """Lock and read every segment whose owner is gone; empty ones are removed at once."""
        self.directory.mkdir(parents=True, exist_ok=True)
        adopted = []
        for path in sorted(self.directory.glob(f"{self._prefix}*{SUFFIX}")):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # applied and removed by its owner meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a live gateway's segment
                continue
            if not path.exists():  # unlinked between our open and our lock: already applied
                os.close(fd)
                continue
            segment = Segment(path.name[len(self._prefix):-len(SUFFIX)], path, fd, synced_dir=True)
            with open(fd, "rb", closefd=False) as f:
                rows = decode(f.read())
            if rows:
                adopted.append((segment, rows))
            else:
                self.discard(segment)
        return adopted

    # Writing ---------------------------------------------------------------------------------
    def new_segment(self) -> Segment:
        flush_id = new_flush_id()
        path = self.directory / f"{self._prefix}{flush_id}{SUFFIX}"
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new file: nobody else can hold it
        return Segment(flush_id, path, fd)

    def append(self, segment: Segment, line: bytes) -> asyncio.Future:
        """Queue ``line`` for ``segment`` now; the future completes once it is durable (group commit)."""
        waiter = asyncio.get_running_loop().create_future()
        with self._lock:
            if not segment.buffer:
                self._dirty.append(segment)
            segment.buffer.append(line)
            self._waiters.append(waiter)
            idle = not self._draining or not self._writer.alive()  # a dead thread drains nothing
            self._draining = True
        if idle:
            try:
                self._writer.wake(self._drain)
            except BaseException:
                with self._lock:
                    self._draining = False
                raise
        return waiter

    def _drain(self) -> None:
        """On the writer thread: write (and fsync) group after group until nothing is buffered.

        Every waiter learns its own group's outcome; a group's lines are on disk before its
        waiters are completed. A failed group fails its waiters only: the next group is
        tried afresh."""
        while True:
            with self._lock:
                if not self._waiters:
                    self._draining = False
                    return
                waiters, self._waiters = self._waiters, []
                groups = self._take_buffers()
            error: BaseException | None = None
            try:
                self._write_groups(groups)
                self.fsyncs += 1
            except BaseException as exc:  # noqa: BLE001 - every waiter must learn the outcome
                error = exc
            with self._lock:
                for segment, _ in groups:
                    segment.writing = False
                    if segment.discarded:
                        segment.close()
            loops: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
            for waiter in waiters:
                loops.setdefault(waiter.get_loop(), []).append(waiter)
            for loop, group in loops.items():
                try:
                    loop.call_soon_threadsafe(_complete, group, error)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

    def _take_buffers(self) -> list[tuple[Segment, bytes]]:
        groups = []
        for segment in self._dirty:
            if segment.buffer:
                groups.append((segment, b"".join(segment.buffer)))
                segment.buffer = []
                segment.writing = True
        self._dirty = []
        return groups

    def _write_groups(self, groups: list[tuple[Segment, bytes]]) -> None:
        for segment, data in groups:
            if segment.fd < 0:
                continue
            view = memoryview(data)
            while view:
                written = os.write(segment.fd, view)
                view = view[written:]
            if self._fsync:
                os.fsync(segment.fd)
                if not segment.synced_dir:  # the new file's name must survive too
                    dir_fd = os.open(self.directory, os.O_RDONLY)
                    try:
                        os.fsync(dir_fd)
                    finally:
                        os.close(dir_fd)
                    segment.synced_dir = True

    # Done: the batch is in the registry ------------------------------------------------------
    def discard(self, segment: Segment) -> None:
        """Remove an applied segment (its lock is dropped once no write to it is running)."""
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass
        with self._lock:
            segment.discarded = True
            if not segment.writing:
                segment.close()

    def close(self, segments: list[Segment]) -> None:
        """Release the locks (the files stay, for the next start to replay); stop the writer
        thread once its queued writes are done (a later append starts it again)."""
        self._writer.stop()
        with self._lock:
            for segment in segments:
                if not segment.writing:
                    segment.close()
