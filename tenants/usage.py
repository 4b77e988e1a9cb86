"""Usage counters per tenant per minute, applied in idempotent batches.

``record_usage`` applies a batch at most once: the batch's ``flush_id`` is inserted into
``usage_flushes`` (primary key) in the same transaction as the counter increments, so a
gateway that crashes after commit and retries the same batch adds nothing, and two
concurrent applications of one batch cannot both commit.

Counters per row: ``requests``, ``prompt_tokens``, ``completion_tokens`` and, of the prompt
tokens, ``cache_read_tokens`` (served from the KV cache: what the APIs report as
``cached_tokens`` / ``cache_read_input_tokens``) and ``cache_write_5m_tokens`` /
``cache_write_1h_tokens`` (kept under a client cache hint, by the TTL they were kept for: what
Messages reports as ``cache_creation``). Per request the three cache counts add up to at most
its prompt tokens (``COUNTS``: the order rows, journal lines and upserts keep them in).

``usage_report`` windows are half-open on minute buckets: a minute is in ``[start, end)`` iff
its start is, so both bounds round the same way (up to the next minute start) and windows
cut at the same instant, aligned or not, never share a minute.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import false, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenants import validation as v
from tenants.common import Page, get_by_ref, paginate, storable_id
from tenants.errors import InvalidField
from tenants.models import Tenant, Usage, UsageFlush

log = logging.getLogger("kvgate.tenants.usage")

# How far before its tenant's creation a usage minute may be and still count. Why: the creation
# time is the admin server's clock and a usage minute the gateway's; a gateway a little behind
# must not lose a new tenant's first requests. Ids are never reused (migration 0011), so within
# this margin a row can only be the new tenant's own.
CLOCK_SKEW_TOLERANCE = timedelta(minutes=5)


# The counters of a usage row, in the order UsageRow, the upsert and the report keep them in.
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cache_read_tokens", "cache_write_5m_tokens",
          "cache_write_1h_tokens")


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant_id: int
    minute: datetime  # any time inside the minute; truncated to the bucket start (UTC)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_read_tokens: int = 0  # of the prompt tokens: served from the KV cache
    cache_write_5m_tokens: int = 0  # of the prompt tokens: kept under a client hint of less than 1 h
    cache_write_1h_tokens: int = 0  # of the prompt tokens: kept under a client hint of 1 h or more


@dataclass(frozen=True, slots=True)
class UsageApplied:
    """What :func:`apply_usage` did with a batch. Invariant: a batch applied before (``applied``
    False) wrote and dropped nothing now; else ``written`` + ``dropped_*`` is the number of
    distinct (tenant, minute) rows in the batch."""

    applied: bool
    written: int = 0  # (tenant, minute) rows added to the counters
    dropped_unknown_tenant: int = 0  # rows of a tenant deleted meanwhile (or an id naming none)
    dropped_before_creation: int = 0  # rows more than CLOCK_SKEW_TOLERANCE before the tenant's creation

    @property
    def dropped(self) -> int:
        return self.dropped_unknown_tenant + self.dropped_before_creation


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int = 0
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0


def minute_bucket(moment: datetime, *, field: str = "minute") -> datetime:
    """The start of ``moment``'s minute in UTC; a naive time or one UTC cannot hold is refused."""
    if not isinstance(moment, datetime) or moment.tzinfo is None:
        raise InvalidField("usage times must be timezone-aware", field=field)
    return v.utc(moment, field=field).replace(second=0, microsecond=0)


def minute_ceiling(moment: datetime, *, field: str) -> datetime | None:
    """The first minute start at or after ``moment`` (UTC); None when there is none (after
    9999-12-31T23:59Z). For a minute start ``m``: ``m >= moment`` iff ``m >= minute_ceiling(moment)``,
    and the same for ``<``, so a window bound rounded so keeps exactly the minutes whose start
    it holds."""
    floor = minute_bucket(moment, field=field)
    if floor == v.utc(moment, field=field):
        return floor
    try:
        return floor + timedelta(minutes=1)
    except OverflowError:
        return None


def _earliest(created_at: datetime) -> datetime:
    """The first usage minute counted for a tenant created at ``created_at``."""
    try:
        return minute_bucket(created_at) - CLOCK_SKEW_TOLERANCE
    except OverflowError:  # created in year 1's first minutes
        return datetime.min.replace(tzinfo=UTC)


def _merge(rows: Iterable[UsageRow]) -> dict[tuple[int, datetime], list[int]]:
    merged: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0] * len(COUNTS))
    for row in rows:
        counts = tuple(getattr(row, name) for name in COUNTS)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise InvalidField("usage counts must be integers >= 0", field="rows")
        acc = merged[(int(row.tenant_id), minute_bucket(row.minute))]
        for i, c in enumerate(counts):
            acc[i] += c
    return merged


def _upsert(session: Session, tenant_id: int, minute: datetime, counts: list[int]):  # type: ignore[no-untyped-def]
    """``INSERT ... ON CONFLICT (tenant_id, minute) DO UPDATE SET x = x + excluded.x`` for every
    counter of ``COUNTS`` (``counts`` in that order; SQLite and PostgreSQL)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported backends
        raise NotImplementedError(f"usage upsert for {dialect}")
    stmt = insert(Usage).values(tenant_id=tenant_id, minute=minute, **dict(zip(COUNTS, counts, strict=True)))
    return stmt.on_conflict_do_update(
        index_elements=[Usage.tenant_id, Usage.minute],
        set_={name: getattr(Usage, name) + stmt.excluded[name] for name in COUNTS},
    )


def record_usage(session: Session, *, flush_id: str, rows: Iterable[UsageRow], now: datetime | None = None) -> bool:
    """Apply a batch once. Returns True if applied now, False if ``flush_id`` was applied before
    (:func:`apply_usage`, which also says how many rows were written and dropped). Commits."""
    return apply_usage(session, flush_id=flush_id, rows=rows, now=now).applied


def apply_usage(session: Session, *, flush_id: str, rows: Iterable[UsageRow],
                now: datetime | None = None) -> UsageApplied:
    """Apply a batch once; what it wrote and dropped (nothing if ``flush_id`` was applied before).

    Rows of tenants deleted meanwhile are skipped (a batch must never become
    un-appliable), and so are rows of a minute more than ``CLOCK_SKEW_TOLERANCE`` before the
    tenant's creation minute: such a row was counted for an earlier tenant, deleted since,
    whose id the tenant now holds (ids are never reused since migration 0011; this guards a
    registry restored from an older copy). Within the tolerance a row is the tenant's own,
    counted on a gateway whose clock is behind the admin server's. Dropped rows are logged
    and counted in the result; the ledger's ``row_count`` is the rows written. Commits.
    """
    if not isinstance(flush_id, str) or not 1 <= len(flush_id) <= 128:
        raise InvalidField("flush_id must be a string of 1-128 chars", field="flush_id")
    merged = _merge(rows)
    try:
        if session.get(UsageFlush, flush_id) is not None:
            session.rollback()
            return UsageApplied(False)
        tenant_ids = {tid for tid, _ in merged if storable_id(tid)}  # another id names no tenant
        earliest = (
            {tid: _earliest(at) for tid, at in session.execute(
                select(Tenant.id, Tenant.created_at).where(Tenant.id.in_(tenant_ids)))}
            if tenant_ids else {}
        )
        known = [(key, counts) for key, counts in merged.items() if key[0] in earliest]
        kept = sorted((key, counts) for key, counts in known if key[1] >= earliest[key[0]])
        early = len(known) - len(kept)
        owners = {tid for (tid, _), _ in kept}
        session.add(
            UsageFlush(
                flush_id=flush_id,
                tenant_id=next(iter(owners)) if len(owners) == 1 else None,
                row_count=len(kept),
                applied_at=now or datetime.now(UTC),
            )
        )
        # Why first: the ledger row takes the write lock / unique slot before any increment.
        session.flush()
        for (tid, minute), counts in kept:
            session.execute(_upsert(session, tid, minute, counts))
        session.commit()
    except IntegrityError:
        # A concurrent application of the same flush_id won the primary key.
        session.rollback()
        if session.get(UsageFlush, flush_id) is not None:
            session.rollback()
            return UsageApplied(False)
        raise
    except BaseException:
        session.rollback()
        raise
    result = UsageApplied(True, len(kept), len(merged) - len(known), early)
    if early:
        log.warning("usage batch %s: %d row(s) dropped, more than %s before their tenant's creation "
                    "(a gateway clock far behind, or a registry restored from an older copy)",
                    flush_id, early, CLOCK_SKEW_TOLERANCE)
    if result.dropped_unknown_tenant:
        log.info("usage batch %s: %d row(s) of deleted tenants skipped", flush_id, result.dropped_unknown_tenant)
    return result


def usage_report(
    session: Session,
    *,
    tenant: int | str,
    start: datetime | None = None,
    end: datetime | None = None,
    limit: int = 500,
    offset: int = 0,
) -> tuple[UsageTotals, Page[Usage]]:
    """Totals over ``[start, end)`` and one page of per-minute rows (oldest first).

    Half-open on minute buckets: a minute counts iff its start is in ``[start, end)``. Both
    bounds round up to the next minute start (:func:`minute_ceiling`), so adjacent windows sum
    to the whole whatever instant they are cut at, and ``[x, x)`` is empty."""
    owner = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant")
    conds = [Usage.tenant_id == owner.id]
    if start is not None:
        first = minute_ceiling(start, field="start")
        conds.append(Usage.minute >= first if first is not None else false())  # None: no minute starts after
    if end is not None:
        stop = minute_ceiling(end, field="end")
        if stop is not None:  # None: every minute starts before it
            conds.append(Usage.minute < stop)
    total = session.execute(
        select(*(func.coalesce(func.sum(getattr(Usage, name)), 0) for name in COUNTS)).where(*conds)
    ).one()
    page = paginate(session, select(Usage).where(*conds).order_by(Usage.minute), limit=limit, offset=offset)
    return UsageTotals(*(int(n) for n in total)), page
