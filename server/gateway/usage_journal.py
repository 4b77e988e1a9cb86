"""An append-only local journal of answered requests' usage, fsynced by default (survives SIGKILL).

Layout: one *segment* file per usage batch, ``<dir>/usage-<registry>-<flush_id>.jsonl``
(``registry``: a fingerprint of the registry database, so gateways of different registries
sharing a directory never replay each other's segments; it names the database, not how it is
reached: see :func:`registry_fingerprint`), one JSON line
per answered request (``{"t": tenant_id, "m": unix minute, "p": prompt, "c": completion}``, then
of the prompt tokens ``"r"`` cache read, ``"w5"`` / ``"w1"`` cache written for 5 m / 1 h, each only
when not 0: a line without them, as an older gateway wrote, reads 0).
A segment the registry refuses for good is moved to ``<dir>/quarantine/`` (never replayed
again; an operator's to inspect).
The segment's file name carries the ``flush_id`` its batch is written to the registry with
(``tenants.usage.record_usage``, applied at most once), so replaying a segment after a
crash can never double count: a batch the dead gateway already committed is refused by its
id, one it had not is applied once.

Invariants:

* a segment is *owned* by the process holding an exclusive ``flock`` on it, from its
  creation (or adoption) until it is applied and unlinked (or quarantined); a gateway adopts
  only segments whose lock it can take, i.e. whose owner died. Several gateways may therefore
  share one directory (a restarted pod replays what a dead one left), and a live
  segment is never replayed behind its owner's back. A segment is created under a hidden
  temporary name (``.usage-…jsonl.new``, which no scan adopts), locked, and only then renamed
  into place, so no scan ever sees an unlocked live segment;
* adoption is bounded: :meth:`UsageJournal.adopt_orphans` takes at most ``limit`` segments per
  call (one descriptor each) and leaves the rest, and any file it cannot open or read now
  (``EMFILE``, ``EIO``), on disk for a later call (``orphans_left``);
* :meth:`UsageJournal.append` returns once the line is on disk (``write`` + ``fsync``;
  a new segment also fsyncs the directory so its name survives). Appends are group
  committed: every line that arrives while one ``fsync`` runs goes into the next one, so
  the cost is one ``fsync`` per group, not per request. With ``fsync=False``
  (``KVGATE_USAGE_JOURNAL_SYNC=write``) it returns once the line is written, with no ``fsync``
  of the segment or of the directory (below);
* a torn or unreadable line (a write the kill interrupted, whose group therefore never
  completed and whose request was not acknowledged as recorded) is skipped at replay, and
  counted (``unreadable_lines``). So is a line whose values the registry cannot store: a
  tenant id that is no storable id, tokens outside ``0 <= n < 2**53``, a minute outside
  2000–2100. After a failed group (a short write on a full disk) the segment's next group
  starts with a newline, so an acknowledged line is never glued to a torn one;
* replay keeps one row per (tenant, minute) of a segment, not one per line;
* after :meth:`UsageJournal.close` nothing is written: an append fails (``OSError``), and so
  does a queued line of a closed segment; only a line of an *applied* (discarded) segment is
  dropped silently, its row being in the committed batch already.

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
import errno
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import make_url

from tenants.common import storable_id
from tenants.usage import COUNTS, UsageRow

log = logging.getLogger("kvgate.gateway.usage")
PREFIX, SUFFIX = "usage-", ".jsonl"
TEMP_SUFFIX = ".new"  # a segment being created: ".usage-<registry>-<flush_id>.jsonl.new"
QUARANTINE = "quarantine"  # segments the registry refused for good
ADOPT_CHUNK = 32  # segments adopted (one descriptor each) per adopt_orphans call
STALE_TEMP_S = 60.0  # a temporary older than this, unlocked, is a crashed creation's leftover
MAX_TOKENS = 2**53  # a line's token counts are below this (sums of a batch stay in BIGINT)
MIN_MINUTE, MAX_MINUTE = 946_684_800 // 60, 4_102_444_800 // 60  # 2000-01-01 .. 2100-01-01 UTC


# Query options naming which database (and schema) a URL reaches; every other option (sslmode,
# connect_timeout, application_name, keepalives ...) says only how it is reached.
_IDENTITY_OPTIONS = frozenset({"dbname", "database", "host", "hostaddr", "port", "service", "options"})
_DEFAULT_PORTS = {"postgresql": 5432}


def registry_fingerprint(database_url: str) -> str:
    """Names one registry whatever the credentials, the driver and the connection options.

    Hashed: the dialect, the host (lower case), the port (the dialect's default when left
    implicit), the database (SQLite: the resolved file), and only the query options that pick
    the database or schema (``_IDENTITY_OPTIONS``, e.g. a ``search_path`` in ``options``).
    The same database reached by another host name or through a pooler still hashes apart:
    the URL alone cannot tell; such segments are counted and warned of at start
    (:meth:`UsageJournal.foreign_segments`). A URL spelled with an explicit default port and
    no options hashes as it did before this normalization (the documented form), so an
    upgraded gateway replays what the previous version left."""
    url = make_url(database_url)
    backend = url.get_backend_name()
    database = url.database or ""
    if backend == "sqlite":
        if database and database != ":memory:":
            database = str(Path(database).resolve())
        host, port, query = "", "", []  # SQLite's options (mode, timeout, uri) never pick another file
    else:
        host = (url.host or "").lower()
        port = url.port or _DEFAULT_PORTS.get(backend) or ""
        query = sorted((k, str(v)) for k, v in url.query.items() if k.lower() in _IDENTITY_OPTIONS)
    ident = f"{backend}|{host}|{port}|{database}|{query}"
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
    discarded: bool = False  # applied and unlinked: a queued line of it is dropped, not failed
    retired: bool = False  # discarded, quarantined or closed: the fd goes once no write runs
    torn: bool = False  # the last group failed, perhaps half written: the next starts with a newline

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1


# A line's optional cache counts (UsageRow's last three counters, in order), written only when not 0.
CACHE_KEYS = ("r", "w5", "w1")


def encode(tenant_id: int, minute: datetime, prompt_tokens: int, completion_tokens: int, cache_read_tokens: int = 0,
           cache_write_5m_tokens: int = 0, cache_write_1h_tokens: int = 0) -> bytes:
    m = int(minute.timestamp()) // 60
    line = {"t": tenant_id, "m": m, "p": prompt_tokens, "c": completion_tokens}
    for key, count in zip(CACHE_KEYS, (cache_read_tokens, cache_write_5m_tokens, cache_write_1h_tokens), strict=True):
        if count:
            line[key] = count
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKENS


def decode_lines(lines: Iterable[bytes]) -> tuple[list[UsageRow], int]:
    """The rows of a segment's lines, merged per (tenant, minute), and how many lines were skipped.

    Skipped: a last line without its newline (torn by a kill), and any line that is not a
    complete record the registry can store (see the module docstring)."""
    merged: dict[tuple[int, int], list[int]] = {}
    skipped = 0
    for line in lines:
        if not line.endswith(b"\n"):  # after the last newline: a line the kill tore
            skipped += 1
            continue
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            t, m, p, c = r["t"], r["m"], r["p"], r["c"]
            cache = [r.get(key, 0) for key in CACHE_KEYS]  # absent (an older gateway's line): 0
        except (ValueError, KeyError, TypeError, ArithmeticError, RecursionError):
            skipped += 1
            continue
        if not (storable_id(t) and isinstance(m, int) and not isinstance(m, bool) and MIN_MINUTE <= m < MAX_MINUTE
                and _count(p) and _count(c) and all(_count(n) for n in cache)):
            skipped += 1
            continue
        acc = merged.setdefault((t, m), [0] * len(COUNTS))
        for i, n in enumerate((1, p, c, *cache)):  # COUNTS' order
            acc[i] += n
    rows = [UsageRow(t, datetime.fromtimestamp(m * 60, UTC), *counts) for (t, m), counts in merged.items()]
    return rows, skipped


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
        self._closed = False
        self.fsyncs = 0  # group commits done (for the benchmark)
        self.orphans_left = True  # the directory may hold segments not adopted yet (never scanned: yes)
        self.unreadable_lines = 0  # lines skipped at adoption (torn, unreadable, unstorable)

    # Start: adopt what dead gateways left ----------------------------------------------------
    def adopt_orphans(self, limit: int = ADOPT_CHUNK) -> list[tuple[Segment, list[UsageRow]]]:
        """Lock and read at most ``limit`` segments whose owner is gone; empty ones are removed at once.

        A file that cannot be opened, locked or read now is left where it is (logged), and so
        is everything past ``limit``: ``orphans_left`` says whether another call may find more."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        adopted: list[tuple[Segment, list[UsageRow]]] = []
        self.orphans_left = False
        failed: list[str] = []
        for path in sorted(self.directory.glob(f"{self._prefix}*{SUFFIX}")):
            if len(adopted) >= limit:
                self.orphans_left = True
                break
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # applied and removed by its owner meanwhile
                continue
            except OSError as exc:
                failed.append(f"{path.name}: {exc.strerror}")
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # the next open fails too: stop here
                    break
                continue
            segment = Segment(path.name[len(self._prefix):-len(SUFFIX)], path, fd, synced_dir=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                segment.close()  # a live gateway's segment (ours included)
                continue
            except OSError as exc:
                segment.close()
                failed.append(f"{path.name}: {exc.strerror}")
                continue
            if not path.exists():  # unlinked between our open and our lock: already applied
                segment.close()
                continue
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    rows, skipped = decode_lines(f)  # line by line: a long outage's segment is not read whole
            except OSError as exc:
                segment.close()  # its lock goes with it: a later call (or gateway) tries again
                failed.append(f"{path.name}: {exc.strerror}")
                continue
            if skipped:
                self.unreadable_lines += skipped
                log.warning("usage journal: skipped %d unreadable line(s) of %s", skipped, path.name)
            if rows:
                adopted.append((segment, rows))
            else:
                self.discard(segment)
        if failed:
            self.orphans_left = True
            log.warning("usage journal: %d segment(s) could not be adopted now, left for later (%s)",
                        len(failed), "; ".join(failed[:3]))
        return adopted

    def foreign_segments(self) -> int:
        """Segments in the directory of another registry fingerprint: never replayed by this gateway."""
        try:
            return sum(1 for p in self.directory.glob(f"{PREFIX}*{SUFFIX}") if not p.name.startswith(self._prefix))
        except OSError:
            return 0

    def _remove_stale_temporaries(self) -> None:
        """Creations that crashed before their rename: empty, unlocked and old (a live one is locked at once)."""
        for path in self.directory.glob(f".{self._prefix}*{SUFFIX}{TEMP_SUFFIX}"):
            try:
                if time.time() - path.stat().st_mtime < STALE_TEMP_S:
                    continue
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink()
            except OSError:
                pass
            finally:
                os.close(fd)

    # Writing ---------------------------------------------------------------------------------
    def new_segment(self) -> Segment:
        """A new segment, locked before its name can be seen by any scan (module docstring)."""
        if self._closed:
            raise OSError(errno.EBADF, "usage journal closed")
        flush_id = new_flush_id()
        path = self.directory / f"{self._prefix}{flush_id}{SUFFIX}"
        temporary = self.directory / f".{path.name}{TEMP_SUFFIX}"
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: only a stale-temporary sweep could race
            os.rename(temporary, path)
        except BaseException:
            os.close(fd)
            try:
                temporary.unlink()
            except OSError:
                pass
            raise
        return Segment(flush_id, path, fd)

    def append(self, segment: Segment, line: bytes) -> asyncio.Future:
        """Queue ``line`` for ``segment`` now; the future completes once it is durable (group commit)."""
        if self._closed:
            raise OSError(errno.EBADF, "usage journal closed")
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
        tried afresh, on a new line of each segment it touched (``torn``)."""
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
                    if error is not None:
                        segment.torn = True
                    if segment.retired:
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
                if segment.discarded:  # applied: these lines' rows are in the committed batch
                    continue
                raise OSError(errno.EBADF, "usage journal segment closed")
            if segment.torn:  # the last group may have left a line without its newline
                data = b"\n" + data
            view = memoryview(data)
            while view:
                written = os.write(segment.fd, view)
                view = view[written:]
            segment.torn = False
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
            segment.discarded = segment.retired = True
            if not segment.writing:
                segment.close()

    def quarantine(self, segment: Segment) -> Path:
        """Move a segment the registry refuses for good to ``quarantine/`` (never adopted again), then drop its lock."""
        target_dir = self.directory / QUARANTINE
        target_dir.mkdir(exist_ok=True)
        target = target_dir / segment.path.name
        os.rename(segment.path, target)  # still locked: no scan adopts it in between
        if self._fsync:
            for directory in (target_dir, self.directory):
                dir_fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        segment.path = target
        with self._lock:
            segment.retired = True
            if not segment.writing:
                segment.close()
        return target

    def close(self, segments: list[Segment]) -> None:
        """Release the locks (the files stay, for the next start to replay); stop the writer
        thread once its queued writes are done. Nothing is written after this: a later append
        fails, and so does a line still queued for one of these segments."""
        self._closed = True
        self._writer.stop()
        with self._lock:
            for segment in segments:
                segment.retired = True
                if not segment.writing:
                    segment.close()
