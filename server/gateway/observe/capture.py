"""Live trace capture: the gateway writes sampled requests as a Mooncake-format JSONL trace.

Opt-in per pool through the admin API (``tenants.captures``). One line per sampled request::

    {"timestamp": 1764596000123, "input_length": 1234, "output_length": 64, "hash_ids": [...],
     "block_size": 32, "tenant": "acme", "retention_class": "chat", "system_tokens": 410,
     "context_tokens": 1100, "cached_gpu_tokens": 384, "cached_host_tokens": 64,
     "ttft_ms": 41.2, "latency_ms": 803.5, "status": "ok",
     "cache_breakpoints": [[410, 3600000], [1234, 300000]], "prompt_cache_retention": "24h"}

The last two appear only when the client sent cache hints (``retention/trace.py``).

``timestamp`` is Unix time in ms at arrival; ``hash_ids`` has one id per ``block_size``
(the pool's ``tokens_per_block``) prompt tokens, the last one for the partial tail block,
as ``retention/trace.py`` requires. ``kvgate simulate`` and ``kvgate analyze`` read these
files unchanged (they take ``block_size`` from the lines).

Privacy invariants:

* no prompt text and no token ids: an id is the gateway's chained block hash
  (``retention.hashing.block_hashes`` with the tenant's engine salt, so salted tenants'
  equal prompts already differ), mapped into the trace's 31-bit id space by BLAKE2b keyed
  with the capture's secret key. Ids of two captures cannot be joined, and an outsider
  who guesses a prompt cannot compute its ids.
* ``shared`` tenants send no salt (they share prefixes in the engine too), so equal
  prefixes of shared tenants get equal ids in one capture: that is real sharing.

Cost invariants (the event loop never waits on the disk):

* ``offer`` runs on the event loop: a dict lookup, a tenant filter, a C-speed search for the
  first end-of-turn token within ``SAMPLING_KEY_TOKENS`` of the system prompt's end and one
  keyed hash of the tokens up to it (the system prompt and at most that much of the first
  message) for the sampling decision (none at ``sample_rate`` 1), and ``put_nowait`` on a
  bounded queue; a full queue drops the line and counts it
  (``kvgate_trace_lines_dropped_total{reason="queue_full"}``).
* hashing, JSON and file writes run on one writer thread. Each file is bounded by the
  capture's ``max_bytes``: the line that would cross it is dropped, the capture is marked
  full (``kvgate_trace_capture_full``) and writes no more lines (stop and start a new
  capture to continue). A file that cannot be opened or written drops its lines as
  ``reason="write_error"`` (logged at most once a minute per pool); each capture opens its
  own file, so one pool's failing directory never stops the others'.
* a file holds whole lines only, and its size is counted from them: a write that fails
  part-way (disk full) is truncated back to the last whole line (or, if that fails too, the
  file is closed and reopened with the next line), and a file opened with a torn last line
  (the process died mid-write) is first truncated to just after its last newline.

Sampling is by conversation: the decision is a keyed hash of the salt and the prompt's
tokens up to and including the end of its first message after the system prompt, which is
the first end-of-turn control token (the tokenizer's, e.g. ``<|im_end|>``, handed to ``offer``)
at or after ``system_end`` (a first message longer than ``SAMPLING_KEY_TOKENS`` is keyed on
its first that many tokens). Control tokens come only from the chat template (a client's
``<|im_end|>`` is plain text), and every turn of a conversation starts with the same system
prompt and first message, so all turns are in or out together (reuse between turns survives
sampling), while conversations sharing only a system prompt are sampled independently.
A prompt without such a token after ``system_end`` (a raw ``/v1/completions`` prompt, no
``turn_ends`` given, a template without one) is keyed on its tokens up to the end of its first
block after ``system_end``. A template that closes a user message with no end-of-turn token
but closes an assistant's with one would key turn 1 and turn 2 differently: the chat templates
served (ChatML and the like) close every message.

Files: ``<trace_dir>/<pool>/capture-<id>-<host>-<pid>.jsonl``: one file per pool per
capture per gateway process (several gateway replicas never write one file).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from struct import Struct

import anyio
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from engines.contract import cached_prompt_tokens
from retention.hashing import block_hashes, chain_hash, pack_tokens, root_hash
from retention.policy.hints import CacheHints
from retention.trace import hint_fields
from tenants.captures import ActiveCapture, active_captures

log = logging.getLogger("kvgate.capture")
_U64 = Struct("<Q")
_ID_MASK = 2**31 - 1
SAMPLING_KEY_TOKENS = 1024  # the most of a first message the sampling key covers (sampling_end)
_ERROR_LOG_INTERVAL_S = 60.0  # a failing trace directory is logged at most this often per pool


def trace_id(key: bytes, block_hash: int) -> int:
    """A block hash in the trace's id space [0, 2^31): BLAKE2b keyed with the capture key."""
    digest = blake2b(_U64.pack(block_hash), key=key[:64], digest_size=4).digest()
    return int.from_bytes(digest, "little") & _ID_MASK


def trace_hash_ids(key: bytes, tokens: np.ndarray, tokens_per_block: int, salt: str | None) -> list[int]:
    """One id per ``tokens_per_block`` tokens, the last for the partial tail block (if any).

    Full blocks: the pool's chained hashes (same as the engine's). The tail is chained the
    same way over its shorter bytes, so it never equals a full block's hash.
    """
    packed = pack_tokens(tokens)
    full = block_hashes(packed, tokens_per_block, salt=salt)
    ids = [trace_id(key, h) for h in full]
    width = tokens_per_block * 4
    tail = packed[len(full) * width:]
    if tail:
        parent = full[-1] if full else root_hash(salt)
        ids.append(trace_id(key, chain_hash(parent, tail)))
    return ids


def sampling_end(tokens: tuple[int, ...], system_end: int, tokens_per_block: int,
                 turn_ends: Collection[int] = ()) -> int:
    """How many leading tokens of the prompt the sampling decision hashes (module docstring).

    The first message after the system segment ends at the first end-of-turn control token at
    or after ``system_end`` (client text never holds one: ``server.gateway.api.prompting``), so
    every turn of a conversation finds the same one. A first message longer than
    ``SAMPLING_KEY_TOKENS`` is cut there (every turn holds those same tokens, and the event loop
    never scans or hashes a long document for a sampling decision). Without such a token (a raw
    prompt, a template without one): the end of the first block after ``system_end``.
    """
    if turn_ends:
        stop = min(len(tokens), system_end + SAMPLING_KEY_TOKENS)
        end = _first_of(tokens, turn_ends, system_end, stop)
        if end >= 0:
            return end + 1
        if stop < len(tokens):  # a first message longer than the cap: its first tokens are the key
            return stop
    return min(len(tokens), (system_end // tokens_per_block + 1) * tokens_per_block)


def _first_of(tokens: tuple[int, ...], wanted: Collection[int], start: int, stop: int) -> int:
    """The first index in ``[start, stop)`` holding one of ``wanted``, or -1.

    ``tuple.index`` (C speed) over windows that double from 256 tokens: a wanted id that is not
    in the prompt costs a scan as long as the first message, not the whole prompt."""
    total, lo, width = stop, start, 256
    while lo < total:
        hi = min(total, lo + width)
        best = -1
        for token in wanted:
            try:  # only before the best hit so far: the earliest wins
                best = tokens.index(token, lo, hi if best < 0 else best)
            except ValueError:
                pass
        if best >= 0:
            return best
        lo, width = hi, width * 2
    return -1


def sampled(key: bytes, salt: str | None, tokens: tuple[int, ...], system_end: int, tokens_per_block: int,
            rate: float, turn_ends: Collection[int] = ()) -> bool:
    """Stable per-conversation sampling decision (see module docstring)."""
    if rate >= 1.0:
        return True
    cut = sampling_end(tokens, system_end, tokens_per_block, turn_ends)
    packed = array("i", tokens[:cut])  # int32, ~5x faster than numpy for a short tuple
    if sys.byteorder == "big":
        packed.byteswap()  # little-endian everywhere, so every gateway of a capture decides alike
    h = blake2b((salt or "").encode() + b"\x00" + packed.tobytes(), key=key[:64], digest_size=8)
    return int.from_bytes(h.digest(), "little") < rate * 2**64


def _open_whole(path: Path) -> tuple[object, int]:
    """Open ``path`` for appending lines, unbuffered (a failed write leaves nothing held in a
    buffer), and return it with its size. A file whose last byte is not a newline (the process
    died mid-line, a partial write on a full disk) is first truncated to just after its last
    newline: the next line must not be glued to the fragment."""
    handle = open(path, "a+b", buffering=0)  # noqa: SIM115 - closed by TraceCaptures._close
    try:
        size = os.fstat(handle.fileno()).st_size
        whole = _whole_lines_size(handle, size)
        if whole != size:
            log.warning("trace capture file %s ends in a torn line: truncated from %d to %d bytes", path, size, whole)
            handle.truncate(whole)
    except OSError:
        handle.close()
        raise
    return handle, whole


def _whole_lines_size(handle, size: int, chunk: int = 1 << 16) -> int:  # noqa: ANN001
    """The length of ``handle``'s content up to and including its last newline (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        handle.seek(start)
        data = handle.read(end - start)
        if end == size and data.endswith(b"\n"):
            return size
        cut = data.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def _write_all(handle, data: bytes) -> None:  # noqa: ANN001
    """Write all of ``data`` to an unbuffered file (a raw write may write less than asked)."""
    view = memoryview(data)
    while view:
        written = handle.write(view)
        if not written:
            raise OSError(f"wrote nothing of {len(view)} bytes")
        view = view[written:]


@dataclass(slots=True)
class CaptureRecord:
    """One finished request, as handed from the event loop to the writer thread."""

    capture_id: int
    arrival_ms: int
    tenant: str
    retention_class: str
    input_ids: tuple[int, ...]
    system_end: int
    context_end: int
    output_length: int
    salt: str | None
    tokens_per_block: int
    cached_gpu_tokens: int
    cached_host_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: str
    hints: CacheHints | None = None  # what the client asked to keep (breakpoints, retention)


@dataclass(slots=True)
class _File:
    capture: ActiveCapture
    path: Path
    handle: object | None = None
    size: int = 0
    full: bool = False


class CaptureMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter("kvgate_trace_lines_total", "Trace lines written by live captures", ["pool"],
                             registry=registry)
        self.dropped = Counter("kvgate_trace_lines_dropped_total",
                               "Sampled trace lines not written (queue_full | size_bound | write_error)",
                               ["pool", "reason"], registry=registry)
        self.bytes = Gauge("kvgate_trace_capture_bytes", "Size of this gateway's file of the pool's active capture",
                           ["pool"], registry=registry)
        self.full = Gauge("kvgate_trace_capture_full", "1 when the active capture's file reached max_bytes",
                          ["pool"], registry=registry)


def _replayable(hints: CacheHints | None, total: int) -> CacheHints | None:
    """The hints a trace line can carry: breakpoints inside the prompt (``retention/trace.py``
    refuses one past ``input_length``), the retention, no key; None when nothing is left."""
    if hints is None:
        return None
    kept = CacheHints(tuple(b for b in hints.breakpoints if b.token_end <= total), retention=hints.retention)
    return None if kept.empty else kept


@dataclass(slots=True)
class TraceCaptures:
    """The gateway's capture service: active captures by pool, a bounded queue, one writer thread."""

    session_factory: Callable
    directory: Path
    registry: CollectorRegistry
    queue_size: int = 10_000
    _active: dict[str, ActiveCapture] = field(default_factory=dict)
    _queue: queue.Queue = field(init=False)
    _thread: threading.Thread | None = None
    _files: dict[int, _File] = field(default_factory=dict)  # writer thread only
    _error_logged: dict[str, tuple[float, int]] = field(default_factory=dict)  # writer thread: pool -> (last log, since)
    metrics: CaptureMetrics = field(init=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue(maxsize=self.queue_size)
        self.metrics = CaptureMetrics(self.registry)

    @property
    def active_pools(self) -> frozenset[str]:
        """Pools this gateway is capturing now (as of its last refresh)."""
        return frozenset(self._active)

    # --- event loop side -------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the active captures from the registry (in a worker thread)."""
        def read() -> list[ActiveCapture]:
            with self.session_factory() as session:
                return active_captures(session)

        rows = await anyio.to_thread.run_sync(read)
        active = {c.pool: c for c in rows}
        self._active = active
        self._ensure_thread()
        self._queue_control(active)

    def _queue_control(self, active: dict[str, ActiveCapture]) -> None:
        try:  # the writer opens new files and closes stopped ones in its own thread
            self._queue.put_nowait(("sync", active))
        except queue.Full:
            pass  # the next refresh tries again

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvgate-trace-writer", daemon=True)
            self._thread.start()

    def offer(self, *, tenant_id: int, tenant: str, retention_class: str, pool: str, tokens_per_block: int,
              salt: str | None, input_ids: tuple[int, ...], system_end: int, context_end: int, output_length: int,
              reused_blocks: int, onboarded_blocks: int, ttft: float | None, latency: float, status: str,
              hints: CacheHints | None = None, turn_ends: Collection[int] = ()) -> bool:
        """Queue one finished request if its pool is captured and it is sampled; never blocks.

        ``turn_ends``: the tokenizer's end-of-turn control token ids for a chat prompt (empty for a
        raw prompt), where the sampling key ends (:func:`sampling_end`)."""
        capture = self._active.get(pool)
        if capture is None or (capture.tenant_id is not None and capture.tenant_id != tenant_id):
            return False
        if not sampled(capture.key, salt, input_ids, system_end, tokens_per_block, capture.sample_rate, turn_ends):
            return False
        total = len(input_ids)
        cached = cached_prompt_tokens(reused_blocks, total, tokens_per_block)
        host = min(cached, onboarded_blocks * tokens_per_block)
        record = CaptureRecord(
            capture.id, int((time.time() - latency) * 1000), tenant, retention_class, input_ids, system_end,
            context_end, output_length, salt, tokens_per_block, cached - host, host,
            None if ttft is None else round(ttft * 1000, 3), round(latency * 1000, 3), status,
            _replayable(hints, total),
        )
        try:
            self._queue.put_nowait(("line", record))
        except queue.Full:
            self.metrics.dropped.labels(pool, "queue_full").inc()
            return False
        return True

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        await anyio.to_thread.run_sync(self._queue.put, ("stop", None))
        await anyio.to_thread.run_sync(thread.join, 10.0)
        self._thread = None

    # --- writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, item = self._queue.get()
            try:
                if kind == "stop":
                    break
                if kind == "sync":
                    self._sync(item)
                else:
                    self._write(item)
            except Exception:  # the writer must outlive one bad line
                log.exception("trace capture writer failed")
        for f in self._files.values():
            self._close(f)
        self._files.clear()

    def _sync(self, active: dict[str, ActiveCapture]) -> None:
        wanted = {c.id: c for c in active.values()}
        for capture_id in list(self._files):
            if capture_id not in wanted:
                f = self._files.pop(capture_id)
                self._close(f)
                self.metrics.bytes.labels(f.capture.pool).set(0)
                self.metrics.full.labels(f.capture.pool).set(0)
        for capture_id, capture in wanted.items():
            if capture_id not in self._files:
                path = self.directory / capture.pool / f"capture-{capture_id:06d}-{socket.gethostname()}-{os.getpid()}.jsonl"
                try:  # each capture on its own: one pool's failing directory never blocks the others
                    path.parent.mkdir(parents=True, exist_ok=True)
                    handle, size = _open_whole(path)
                except OSError:
                    self._log_failure(capture.pool, "cannot open trace capture file %s", path)
                    continue  # its lines are counted write_error; the next line tries again
                self._files[capture_id] = _File(capture, path, handle, size, size >= capture.max_bytes)
                self.metrics.bytes.labels(capture.pool).set(size)
                self.metrics.full.labels(capture.pool).set(int(size >= capture.max_bytes))

    def _log_failure(self, pool: str, message: str, path: Path) -> None:
        """Log a file failure with its traceback at most once per ``_ERROR_LOG_INTERVAL_S`` per pool
        (a failing directory fails every line); the lines themselves are counted write_error."""
        now = time.monotonic()
        last, since = self._error_logged.get(pool, (None, 0))
        if last is not None and now - last < _ERROR_LOG_INTERVAL_S:
            self._error_logged[pool] = (last, since + 1)
            return
        self._error_logged[pool] = (now, 0)
        log.warning(message + " (pool %s; %d more failures since the last report, next report in %.0f s at the earliest)",
                    path, pool, since, _ERROR_LOG_INTERVAL_S, exc_info=True)

    def _cut_back(self, f: _File, capture_id: int) -> None:
        """After a failed write (disk full: part of the line may be on disk), truncate the file back
        to its last whole line, ``f.size``. If that fails too, close it and forget it: the next
        line reopens it, and the open cuts the torn line (``_open_whole``)."""
        try:
            f.handle.truncate(f.size)  # type: ignore[attr-defined]
        except OSError:
            log.warning("cannot truncate trace capture file %s back to %d bytes; reopening it with the next line",
                        f.path, f.size, exc_info=True)
            try:
                self._close(f)
            except OSError:
                f.handle = None
            self._files.pop(capture_id, None)

    @staticmethod
    def _close(f: _File) -> None:
        if f.handle is not None:
            f.handle.close()  # type: ignore[attr-defined]
            f.handle = None

    def _write(self, r: CaptureRecord) -> None:
        f = self._files.get(r.capture_id)
        if f is None:  # stopped before the line reached the writer, or the sync is still queued
            active = self._active
            capture = next((c for c in active.values() if c.id == r.capture_id), None)
            if capture is None:
                return
            self._sync(active)
            f = self._files.get(r.capture_id)
            if f is None:  # its file could not be opened (logged by _sync)
                self.metrics.dropped.labels(capture.pool, "write_error").inc()
                return
        pool = f.capture.pool
        if f.full:
            self.metrics.dropped.labels(pool, "size_bound").inc()
            return
        ids = trace_hash_ids(f.capture.key, np.asarray(r.input_ids, dtype=np.int32), r.tokens_per_block, r.salt)
        line = {
            "timestamp": r.arrival_ms, "input_length": len(r.input_ids), "output_length": r.output_length,
            "hash_ids": ids, "block_size": r.tokens_per_block, "tenant": r.tenant,
            "retention_class": r.retention_class, "system_tokens": r.system_end, "context_tokens": r.context_end,
            "cached_gpu_tokens": r.cached_gpu_tokens, "cached_host_tokens": r.cached_host_tokens,
            "ttft_ms": r.ttft_ms, "latency_ms": r.latency_ms, "status": r.status,
            # The client's hints as it sent them (the class's caps are the replay's business);
            # never prompt_cache_key: a client string, and nothing the simulator needs.
            **hint_fields(r.hints),
        }
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        if f.size + len(data) > f.capture.max_bytes:
            f.full = True
            self.metrics.full.labels(pool).set(1)
            self.metrics.dropped.labels(pool, "size_bound").inc()
            log.warning("trace capture %d of pool %s reached max_bytes=%d; no more lines", r.capture_id, pool,
                        f.capture.max_bytes)
            return
        try:
            _write_all(f.handle, data)
        except OSError:
            self.metrics.dropped.labels(pool, "write_error").inc()
            self._log_failure(pool, "trace capture write failed: %s", f.path)
            self._cut_back(f, r.capture_id)
            return
        f.size += len(data)
        self.metrics.lines.labels(pool).inc()
        self.metrics.bytes.labels(pool).set(f.size)
