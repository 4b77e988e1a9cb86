"""Opening a trace file: JSONL, plain or gzip-compressed, decoded strictly as UTF-8.

``kvgate analyze`` (its DuckDB tables and its simulator curve) and ``kvgate simulate``
open traces here, so a ``.jsonl.gz`` export reads the same in both, and a byte that is not
UTF-8 is named by its line at once instead of surfacing as a codec error mid-replay.

Compression is told by content, not by name: a file starting with the gzip magic
``1f 8b`` is gzip whatever it is called (JSON text never starts with byte ``0x1f``).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"


class TraceFileError(ValueError):
    """The file cannot be read as UTF-8 JSONL; the message names the line where it can."""


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with the gzip magic (False when it cannot be read: opening it says why)."""
    try:
        with path.open("rb") as handle:
            return handle.read(2) == GZIP_MAGIC
    except OSError:
        return False


@contextmanager
def trace_lines(path: Path) -> Iterator[Iterator[str]]:
    """The lines of ``path`` (newline kept), gunzipped if need be, each decoded as UTF-8.

    Iterating raises :class:`TraceFileError` at the first line that is not UTF-8
    (``line N: not valid UTF-8``, N counting every line from 1, blank ones too, as
    ``retention.trace`` numbers them) or where the file stops being readable.
    """
    try:
        handle: BinaryIO = gzip.open(path, "rb") if is_gzip(path) else path.open("rb")  # type: ignore[assignment]
    except OSError as exc:
        raise TraceFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        yield _decoded(handle)


def _decoded(handle: BinaryIO) -> Iterator[str]:
    number = 0
    while True:
        try:
            raw = handle.readline()
        except (OSError, EOFError, zlib.error) as exc:  # a corrupt or truncated gzip stream
            raise TraceFileError(f"line {number + 1}: cannot read on ({exc})") from None
        if not raw:
            return
        number += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFileError(f"line {number}: not valid UTF-8") from None
        yield text
