"""`kvgate trace start|stop|list|export`: live trace captures from the shell.

``start``/``stop``/``list`` go through the same registry services as the admin API
(``/admin/v1/pools/{ref}/captures``), audited as ``cli:<user>``. ``export`` reads the
gateways' capture files under the trace directory (``KVGATE_TRACE_DIR``, or ``--dir``)
and writes one time range of one pool, in timestamp order, as a trace that
``kvgate simulate`` and ``kvgate analyze`` read unchanged::

    kvgate trace start reference --sample-rate 0.25 --max-bytes 512MiB
    kvgate trace export --pool reference --from 2026-12-01T14:00:00Z --to 2026-12-01T15:00:00Z -o hour.jsonl
    kvgate analyze hour.jsonl --plots report/
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from server.cli.options import (
    Limit, Offset, PoolArg, cli_actor, fail, load_settings, page_of, print_json, registry_session, utc_now,
    validate_body,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


CaptureId = Annotated[int, typer.Argument(metavar="ID", help="capture id")]


class ExportError(ValueError):
    pass


def parse_size(text: str) -> int:
    """``"512MiB"`` → 536870912; ``"1GB"`` → 10^9; ``"1000"`` → 1000 bytes."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ExportError(f"size {text!r} must be bytes or a number with KiB/MiB/GiB/KB/MB/GB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_time_ms(text: str, *, field: str) -> int:
    """Unix ms (``1764597600000``) or ISO 8601 (``2026-12-01T14:00:00Z``; no zone = UTC)."""
    raw = text.strip()
    if raw.isdigit():
        return int(raw)
    try:
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ExportError(f"{field} {text!r} must be Unix ms or an ISO 8601 time like 2026-12-01T14:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def capture_files(directory: Path, pool: str, capture: int | None = None) -> list[Path]:
    """The capture files of ``pool`` (all gateways, all captures, or one capture id)."""
    pattern = f"capture-{capture:06d}-*.jsonl" if capture is not None else "capture-*.jsonl"
    return sorted((directory / pool).glob(pattern))


_CAPTURE_FILE = re.compile(r"^capture-(\d+)-")


def _capture_of(file: Path) -> str:
    """The capture id in a capture file's name (``capture-000012-host-pid.jsonl`` → ``"12"``)."""
    match = _CAPTURE_FILE.match(file.name)
    return str(int(match.group(1))) if match else file.name


@dataclass(slots=True)
class _SizeSpan:
    """The selected lines of one block size in one capture: first and last timestamp, the first's file."""

    first_ms: float
    last_ms: float
    file: Path

    def widen(self, ts: float, file: Path) -> None:
        if ts < self.first_ms:
            self.first_ms, self.file = ts, file
        self.last_ms = max(self.last_ms, ts)


def _ms(ts: float) -> str:
    return str(int(ts)) if ts == int(ts) else str(ts)


def _mixed_sizes(seen: dict[tuple[str, object], _SizeSpan]) -> str:
    """Why lines of several block sizes cannot be one trace, and how to export them apart.

    Within one capture (the pool's engine rebuilt with another ``tokens_per_block`` while it
    ran): the file and timestamp of the first line of the later size, and the time ranges to
    export apart. Across captures only: one capture per export."""
    by_capture: dict[str, list[tuple[object, _SizeSpan]]] = {}
    for (capture, size), span in seen.items():
        by_capture.setdefault(capture, []).append((size, span))
    for capture, spans in sorted(by_capture.items()):
        if len(spans) < 2:
            continue
        spans.sort(key=lambda item: item[1].first_ms)
        (old, before), (new, after) = spans[0], spans[1]
        change = after.first_ms
        resume = max(change, before.last_ms + 1)  # a gateway may still have written the old size after the change
        return (f"{after.file}: block_size changes from {old} to {new} within capture {capture}, first at timestamp "
                f"{_ms(change)} ms (the pool's engine was rebuilt with another tokens_per_block during the "
                f"capture); export the two parts separately: --to {_ms(change)}, then --from {_ms(resume)}")
    (first_capture, first_size), first = min(seen.items(), key=lambda item: item[1].first_ms)
    (other_capture, other_size), other = min(((key, span) for key, span in seen.items() if key[1] != first_size),
                                             key=lambda item: item[1].first_ms)
    return (f"{other.file}: block_size {other_size} (capture {other_capture}, first at timestamp "
            f"{_ms(other.first_ms)} ms) differs from {first_size} in capture {first_capture} ({first.file}); "
            "export one capture (--capture ID)")


def export_range(files: list[Path], out: Path, *, start_ms: int | None, end_ms: int | None) -> tuple[int, int | None]:
    """Write the lines with ``start_ms <= timestamp < end_ms`` sorted by timestamp.

    Returns (lines written, block size). Lines are copied byte for byte (no re-encoding);
    a line that is not a JSON object with a numeric timestamp (e.g. a torn last line of a
    file being written) is skipped; lines of different block sizes are refused (the message
    says how to export them apart: by time range within one capture, by capture across
    captures), and so is a line that is not UTF-8 (the gateway never writes one: the file is
    damaged). When no line is selected nothing is written: an empty trace would only fail
    later, in analyze.
    """
    from server.analysis.trace_file import TraceFileError, trace_lines

    selected: list[tuple[float, int, str]] = []
    seen: dict[tuple[str, object], _SizeSpan] = {}  # (capture, block_size) -> where the lines of that size are
    for file in files:
        capture = _capture_of(file)
        try:
            with trace_lines(file) as handle:
                for text in handle:
                    if not text.endswith("\n"):
                        continue  # the writer's current line, not complete yet
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError:
                        continue
                    ts = obj.get("timestamp") if isinstance(obj, dict) else None
                    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                        continue
                    if (start_ms is not None and ts < start_ms) or (end_ms is not None and ts >= end_ms):
                        continue
                    size = obj.get("block_size")
                    if isinstance(size, (list, dict)):  # a damaged line: compared by its text
                        size = json.dumps(size)
                    span = seen.get((capture, size))
                    if span is None:
                        seen[(capture, size)] = _SizeSpan(ts, ts, file)
                    else:
                        span.widen(ts, file)
                    selected.append((float(ts), len(selected), text))
        except TraceFileError as exc:
            raise ExportError(f"{file}: {exc}") from None
    if not selected:
        raise ExportError(f"no captured request in the time range ({len(files)} file(s) read); nothing written")
    sizes = {size for _, size in seen}
    if len(sizes) > 1:
        raise ExportError(_mixed_sizes(seen))
    block_size = next(iter(sizes))
    selected.sort()
    _write_replacing(out, (text for _, _, text in selected))
    return len(selected), block_size


def _write_replacing(out: Path, lines: Iterable[str]) -> None:
    """Write ``lines`` to a temporary file beside ``out``, then rename it over ``out``: a failed
    write (full disk, interrupt) leaves an existing ``out`` as it was, never truncated. A symlink
    is followed, as opening ``out`` would; a new file gets the umask's mode, a replaced one keeps its own."""
    import os
    import tempfile

    target = out.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        mode = target.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.writelines(lines)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output(out: Path, files: list[Path], capture_dir: Path) -> None:
    """Refuse an output that is one of the capture files read (it would be truncated while read)
    or lies in the pool's capture directory (the next export would read it back as a capture)."""
    target = out.resolve()
    if target in {f.resolve() for f in files}:
        raise ExportError(f"-o {out} is one of the capture files being exported; write the trace elsewhere")
    if target.is_relative_to(capture_dir.resolve()):
        raise ExportError(f"-o {out} is inside the pool's capture directory {capture_dir}; write the trace elsewhere "
                          "(a later export would read it as a capture)")


def _public(capture: dict) -> dict:
    """A capture as the admin API shows it (``CapturePublic``): times in RFC 3339, ``...Z``."""
    from server.admin.captures import CapturePublic

    return CapturePublic.model_validate(capture).model_dump(mode="json")


def register(app: typer.Typer) -> None:
    """Attach ``kvgate trace`` to the root CLI."""
    group = typer.Typer(no_args_is_help=True, help="Live trace captures: start, stop, list, export.")
    app.add_typer(group, name="trace")

    @group.command()
    def start(
        pool: PoolArg,
        sample_rate: Annotated[float, typer.Option("--sample-rate", help="share of conversations captured, (0, 1]")] = 1.0,
        max_bytes: Annotated[str, typer.Option("--max-bytes", help="size bound per gateway file, e.g. 256MiB")] = "256MiB",
        tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant's requests")] = None,
    ) -> None:
        """Start capturing POOL's requests (every gateway picks it up within seconds)."""
        from server.admin.captures import CaptureCreate
        from tenants import captures

        try:
            size = parse_size(max_bytes)
        except ExportError as exc:
            fail(2, "invalid_value", str(exc), "max_bytes")
        with registry_session() as s:
            body = validate_body(CaptureCreate, sample_rate=sample_rate, max_bytes=size, tenant=tenant)
            row = captures.start_capture(s, actor=cli_actor(), now=utc_now(), pool=pool, **body.model_dump())
            print_json(_public(captures.capture_public(row, s)))

    @group.command()
    def stop(pool: PoolArg, capture_id: Annotated[int, typer.Argument(metavar="ID", help="capture id")]) -> None:
        """Stop a capture."""
        from tenants import captures

        with registry_session() as s:
            print_json(_public(captures.capture_public(captures.stop_capture(s, actor=cli_actor(), now=utc_now(), pool=pool,
                                                                         capture_id=capture_id), s)))

    @group.command("list")
    def list_(pool: PoolArg, limit: Limit = 50, offset: Offset = 0) -> None:
        """The pool's captures, newest first, a page at a time (as ``admin ... list``)."""
        from tenants import captures

        with registry_session() as s:
            print_json(page_of(None, captures.list_captures(s, pool=pool, limit=limit, offset=offset), convert=_public))

    @group.command()
    def export(
        pool: Annotated[str, typer.Option("--pool", help="pool name (a directory under the trace dir)")],
        output: Annotated[Path, typer.Option("--output", "-o", help="trace file to write (JSONL)")],
        start_at: Annotated[str | None, typer.Option("--from", help="first time (inclusive): ISO 8601 or Unix ms")] = None,
        end_at: Annotated[str | None, typer.Option("--to", help="last time (exclusive): ISO 8601 or Unix ms")] = None,
        capture: Annotated[int | None, typer.Option("--capture", help="only this capture id")] = None,
        directory: Annotated[Path | None, typer.Option("--dir", help="trace directory (default KVGATE_TRACE_DIR)")] = None,
    ) -> None:
        """Write one pool's captured requests in a time range, sorted by timestamp."""
        try:
            if directory is None:
                directory = load_settings().trace_dir  # an invalid KVGATE_* variable: one line, exit 2
            start_ms = parse_time_ms(start_at, field="--from") if start_at else None
            end_ms = parse_time_ms(end_at, field="--to") if end_at else None
            if start_ms is not None and end_ms is not None and end_ms <= start_ms:
                raise ExportError("--to must be after --from")
            files = capture_files(directory, pool, capture)
            if not files:
                raise ExportError(f"no capture files for pool {pool!r} under {directory}"
                                  + (f" (capture {capture})" if capture is not None else ""))
            check_output(output, files, directory / pool)
            count, block_size = export_range(files, output, start_ms=start_ms, end_ms=end_ms)
        except (ExportError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{count} requests written to {output} (block size {block_size}, from {len(files)} file(s))")
