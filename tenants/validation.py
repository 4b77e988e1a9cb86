"""Field rules shared by every writer (admin API, CLI, tests).

The admin schemas repeat the simple bounds so OpenAPI shows them; these checks are the
authority, so the CLI and direct service calls get the same errors with the same field
names. Priority/duration rules come from ``retention.types`` (TensorRT-LLM semantics).
"""

from __future__ import annotations

import math
import re
import unicodedata
from datetime import UTC, datetime
from typing import Any

from retention.types import RetentionPlanError, check_duration, check_priority
from tenants.errors import InvalidField
from tenants.models import ISOLATIONS, REPLICA_STATES, TENANT_STATUSES

# Lowercase names, not all digits: a path segment is then unambiguously an id or a name.
# \Z, not $: Python's $ also matches before a trailing newline ("gpu-a\n" is not a name).
NAME_RE = re.compile(r"^(?![0-9]+\Z)[a-z0-9][a-z0-9._-]{0,63}\Z")

# A replica's gRPC endpoint: host:port, host a DNS name / IPv4 / [IPv6], port 1..65535.
# One pattern for the service check (re.fullmatch) and the admin schema (OpenAPI).
ENDPOINT_PATTERN = (
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,250})|\[[0-9A-Fa-f:.]{2,45}\])"
    r":(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})$"
)
_ENDPOINT_RE = re.compile(ENDPOINT_PATTERN)


def name(value: Any, *, field: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise InvalidField(
            f"{field} must be 1-64 chars of [a-z0-9._-], start with a letter or digit and not be all digits",
            field=field,
        )
    return value


# Characters a name shown in logs, the audit log and the console must not carry: controls,
# format characters (bidi overrides make one name read as another), line/paragraph separators.
UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def first_unprintable(value: str) -> str | None:
    """The first character of ``value`` in :data:`UNPRINTABLE_CATEGORIES`, or None."""
    return next((c for c in value if unicodedata.category(c) in UNPRINTABLE_CATEGORIES), None)


def text(value: Any, *, field: str, max_len: int, allow_empty: bool = False) -> str:
    if isinstance(value, str) and "\x00" in value:
        raise InvalidField(f"{field} must not contain NUL characters", field=field)
    if not isinstance(value, str) or len(value) > max_len or (not allow_empty and not value.strip()):
        raise InvalidField(
            f"{field} must be a {'' if allow_empty else 'non-empty '}string of at most {max_len} chars", field=field
        )
    return value


def priority(value: Any, *, field: str) -> int:
    try:
        return check_priority(value, field=field)
    except RetentionPlanError as exc:
        raise InvalidField(str(exc), field=field) from exc


# The engine contract carries durations as INT32 milliseconds (engines/contract.py).
MAX_DURATION_MS = 2**31 - 1


def duration(value: Any, *, field: str) -> int | None:
    try:
        checked = check_duration(value, field=field)
    except RetentionPlanError as exc:
        raise InvalidField(str(exc), field=field) from exc
    if checked is not None and checked > MAX_DURATION_MS:
        raise InvalidField(f"{field} must be at most {MAX_DURATION_MS} ms (INT32), got {checked}", field=field)
    return checked


def integer(value: Any, *, field: str, minimum: int, maximum: int = 2**31 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidField(f"{field} must be an integer in [{minimum}, {maximum}], got {value!r}", field=field)
    return value


def fraction(value: Any, *, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise InvalidField(f"{field} must be a number in (0, 1], got {value!r}", field=field)
    return float(value)


def boolean(value: Any, *, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidField(f"{field} must be true or false, got {value!r}", field=field)
    return value


def positive_duration(value: Any, *, field: str) -> int:
    """A duration that must be given and expire (> 0 ms, INT32 like every engine duration)."""
    checked = duration(value, field=field)
    if checked is None or checked <= 0:
        raise InvalidField(f"{field} must be an integer number of ms > 0, got {value!r}", field=field)
    return checked


def choice(value: Any, *, field: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise InvalidField(f"{field} must be one of {', '.join(options)}; got {value!r}", field=field)
    return value


def isolation(value: Any, *, field: str = "isolation") -> str:
    return choice(value, field=field, options=ISOLATIONS)


def status(value: Any, *, field: str = "status") -> str:
    return choice(value, field=field, options=TENANT_STATUSES)


def endpoint(value: Any, *, field: str) -> str:
    if not isinstance(value, str) or len(value) > 256 or not _ENDPOINT_RE.fullmatch(value):
        raise InvalidField(
            f"{field} must be host:port (a DNS name, IPv4 or [IPv6] address, port 1-65535), got {str(value)[:80]!r}",
            field=field,
        )
    return value


def replica_state(value: Any, *, field: str = "state") -> str:
    return choice(value, field=field, options=REPLICA_STATES)


def utc(value: Any, *, field: str) -> datetime:
    """A timezone-aware time, in UTC. A naive one, or one UTC cannot hold (9999-12-31T23:59-05:00
    or 0001-01-01T00:00+05:00: converting overflows the year) is refused naming ``field``."""
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidField(f"{field} must be a timezone-aware time (ISO 8601 with an offset)", field=field)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise InvalidField(f"{field} must be a time UTC can hold (years 1 to 9999 once converted to UTC), "
                           f"got {value.isoformat()}", field=field) from None


def filter_text(value: Any, *, field: str) -> str:
    """A text filter: a string without NUL (no stored value holds one, and PostgreSQL refuses
    it as a parameter), so a filter behaves the same on every backend."""
    if not isinstance(value, str) or "\x00" in value:
        raise InvalidField(f"{field} must be a string without NUL characters", field=field)
    return value


def future_utc(value: datetime, *, now: datetime, field: str) -> datetime:
    """A timezone-aware time after ``now``, in UTC; one UTC cannot hold (year 9999 with a
    negative offset) is refused rather than overflowing."""
    try:
        utc = value.astimezone(UTC) if value.tzinfo is not None else None
    except OverflowError:
        utc = None
    if utc is None or utc <= now:
        raise InvalidField(f"{field} must be a timezone-aware time in the future (UTC-representable)", field=field)
    return utc
