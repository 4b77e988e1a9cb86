"""Opening a trace file: JSONL, plain or gzip-compressed, decoded strictly as UTF-8.

``kvgate analyze`` (its DuckDB tables and its simulator curve) and ``kvgate simulate``
open traces here, so a ``.jsonl.gz`` export reads the same in both, and a byte that is not
UTF-8 is named by its line at once instead of surfacing as a codec error mid-replay.

Compression is told by content, not by name: a file starting with the gzip magic
``1f 8b`` is gzip whatever it is called (JSON text never starts with byte ``0x1f``).
zstd, bzip2 and xz files (:data:`MAGICS`) are refused by name up front, not as "not valid
UTF-8": DuckDB reads zstd, but the simulator's reader would need a package kvgate does not
depend on (Python 3.11 has no zstd), and DuckDB reads neither bzip2 nor xz.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"
# First bytes of compressed files (no JSON text starts with any of them): the compression and,
# for those not read, the command that undoes it. Only gzip is read.
MAGICS: tuple[tuple[bytes, str, str | None], ...] = (
    (GZIP_MAGIC, "gzip", None),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
    (b"BZh", "bzip2", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
)


class TraceFileError(ValueError):
    """The file cannot be read as UTF-8 JSONL; the message names the line where it can."""


def compression(path: Path) -> str | None:
    """The compression ``path``'s first bytes name (:data:`MAGICS`), None for none or a file
    that cannot be read (opening it says why)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(max(len(magic) for magic, _, _ in MAGICS))
    except OSError:
        return None
    return next((name for magic, name, _ in MAGICS if head.startswith(magic)), None)


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with the gzip magic (False when it cannot be read: opening it says why)."""
    return compression(path) == "gzip"


def check_compression(path: Path) -> None:
    """Raise :class:`TraceFileError` (one line, naming the compression) for a compressed file that is not read."""
    name = compression(path)
    undo = next((undo for _, known, undo in MAGICS if known == name), None)
    if undo is not None:
        raise TraceFileError(f"the file is {name}-compressed, which kvgate does not read: decompress it ({undo}) "
                             "or compress it with gzip instead")


@contextmanager
def trace_lines(path: Path) -> Iterator[Iterator[str]]:
    """The lines of ``path`` (newline kept), gunzipped if need be, each decoded as UTF-8.

    Raises :class:`TraceFileError` for a compression other than gzip (:func:`check_compression`);
    iterating raises it at the first line that is not UTF-8
    (``line N: not valid UTF-8``, N counting every line from 1, blank ones too, as
    ``retention.trace`` numbers them) or where the file stops being readable.
    """
    check_compression(path)
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
