"""Usage counters per tenant per minute, applied in idempotent batches.

``record_usage`` applies a batch at most once: the batch's ``flush_id`` is inserted into
``usage_flushes`` (primary key) in the same transaction as the counter increments, so a
gateway that crashes after commit and retries the same batch adds nothing, and two
concurrent applications of one batch cannot both commit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenants import validation as v
from tenants.common import Page, get_by_ref, paginate, storable_id
from tenants.errors import InvalidField
from tenants.models import Tenant, Usage, UsageFlush


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant_id: int
    minute: datetime  # any time inside the minute; truncated to the bucket start (UTC)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int
    prompt_tokens: int
    completion_tokens: int


def minute_bucket(moment: datetime, *, field: str = "minute") -> datetime:
    """The start of ``moment``'s minute in UTC; a naive time or one UTC cannot hold is refused."""
    if not isinstance(moment, datetime) or moment.tzinfo is None:
        raise InvalidField("usage times must be timezone-aware", field=field)
    return v.utc(moment, field=field).replace(second=0, microsecond=0)


def _merge(rows: Iterable[UsageRow]) -> dict[tuple[int, datetime], list[int]]:
    merged: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in rows:
        counts = (row.requests, row.prompt_tokens, row.completion_tokens)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise InvalidField("usage counts must be integers >= 0", field="rows")
        acc = merged[(int(row.tenant_id), minute_bucket(row.minute))]
        for i, c in enumerate(counts):
            acc[i] += c
    return merged


def _upsert(session: Session, tenant_id: int, minute: datetime, req: int, ptok: int, ctok: int):  # type: ignore[no-untyped-def]
    """``INSERT ... ON CONFLICT (tenant_id, minute) DO UPDATE SET x = x + excluded.x`` (SQLite and PostgreSQL)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported backends
        raise NotImplementedError(f"usage upsert for {dialect}")
    stmt = insert(Usage).values(
        tenant_id=tenant_id, minute=minute, requests=req, prompt_tokens=ptok, completion_tokens=ctok
    )
    return stmt.on_conflict_do_update(
        index_elements=[Usage.tenant_id, Usage.minute],
        set_={
            "requests": Usage.requests + stmt.excluded.requests,
            "prompt_tokens": Usage.prompt_tokens + stmt.excluded.prompt_tokens,
            "completion_tokens": Usage.completion_tokens + stmt.excluded.completion_tokens,
        },
    )


def record_usage(session: Session, *, flush_id: str, rows: Iterable[UsageRow], now: datetime | None = None) -> bool:
    """Apply a batch once. Returns True if applied now, False if ``flush_id`` was applied before.

    Rows of tenants deleted meanwhile are skipped (a batch must never become
    un-appliable), and so are rows of a minute before the tenant's creation minute: such a
    row was counted for an earlier tenant, deleted since, whose id the tenant now holds (ids
    are never reused since migration 0011; this also guards a registry restored from an
    older copy). Commits.
    """
    if not isinstance(flush_id, str) or not 1 <= len(flush_id) <= 128:
        raise InvalidField("flush_id must be a string of 1-128 chars", field="flush_id")
    merged = _merge(rows)
    try:
        if session.get(UsageFlush, flush_id) is not None:
            session.rollback()
            return False
        tenant_ids = {tid for tid, _ in merged if storable_id(tid)}  # another id names no tenant
        born = (
            {tid: minute_bucket(at) for tid, at in session.execute(
                select(Tenant.id, Tenant.created_at).where(Tenant.id.in_(tenant_ids)))}
            if tenant_ids else {}
        )
        kept = sorted((key, counts) for key, counts in merged.items() if key[0] in born and key[1] >= born[key[0]])
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
        for (tid, minute), (req, ptok, ctok) in kept:
            session.execute(_upsert(session, tid, minute, req, ptok, ctok))
        session.commit()
        return True
    except IntegrityError:
        # A concurrent application of the same flush_id won the primary key.
        session.rollback()
        if session.get(UsageFlush, flush_id) is not None:
            session.rollback()
            return False
        raise
    except BaseException:
        session.rollback()
        raise


def usage_report(
    session: Session,
    *,
    tenant: int | str,
    start: datetime | None = None,
    end: datetime | None = None,
    limit: int = 500,
    offset: int = 0,
) -> tuple[UsageTotals, Page[Usage]]:
    """Totals over ``[start, end)`` and one page of per-minute rows (oldest first)."""
    owner = get_by_ref(session, Tenant, tenant, name_attr="slug", what="tenant")
    conds = [Usage.tenant_id == owner.id]
    if start is not None:
        conds.append(Usage.minute >= minute_bucket(start, field="start"))
    if end is not None:
        conds.append(Usage.minute < v.utc(end, field="end"))
    total = session.execute(
        select(
            func.coalesce(func.sum(Usage.requests), 0),
            func.coalesce(func.sum(Usage.prompt_tokens), 0),
            func.coalesce(func.sum(Usage.completion_tokens), 0),
        ).where(*conds)
    ).one()
    page = paginate(session, select(Usage).where(*conds).order_by(Usage.minute), limit=limit, offset=offset)
    return UsageTotals(int(total[0]), int(total[1]), int(total[2])), page
