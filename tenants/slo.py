"""A pool's SLO budget: the settings of the gateway's SLO guard (``retention.rollout.guard``).

At most one budget per pool (``pool_slo_budgets``), set as a whole (``set_budget``: the
fields not given take their defaults) and removed with ``delete_budget`` (the guard is
then off). Values are checked by ``retention.rollout.guard.SloBudget`` itself, so the
registry cannot hold a budget the guard would refuse. Every change is one transaction
with one audit event (``entity_type="pool_slo"``, ``entity_id`` = the pool's id).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from retention.rollout.guard import MAX_MIN_REQUESTS, GuardError, SloBudget
from tenants import audit
from tenants.common import check_version, mutation, snapshot, versioned_update
from tenants.errors import InvalidField, NotFound
from tenants.models import PoolSloBudget
from tenants.pools import get_pool

ENTITY = "pool_slo"
DEFAULTS: dict[str, Any] = {
    "ttft_p99_ms": None, "itl_p99_ms": None, "window_seconds": 60, "min_requests": 20, "cooldown_seconds": 300,
    "hysteresis": 0.2, "enabled": True, "pilot_fraction": 1.0,
}
_INTEGERS = ("ttft_p99_ms", "itl_p99_ms", "window_seconds", "min_requests", "cooldown_seconds")
# Upper bounds, one definition for the service, the admin API's schema and the registry file
# (the columns are INTEGER: an unbounded value would not even be storable on PostgreSQL).
# MAX_MIN_REQUESTS is the guard's (retention.rollout.guard): the samples its window keeps per
# latency; a budget needing more could never trip.
MAX_SECONDS = 7 * 24 * 3600
MAX_BUDGET_MS = 3_600_000  # an hour: no p99 budget is longer
_MAXIMUMS = {"ttft_p99_ms": (MAX_BUDGET_MS, "ms (an hour)"), "itl_p99_ms": (MAX_BUDGET_MS, "ms (an hour)"),
             "window_seconds": (MAX_SECONDS, "(a week)"),
             "min_requests": (MAX_MIN_REQUESTS, "requests (the samples the guard keeps)"),
             "cooldown_seconds": (MAX_SECONDS, "(a week)")}


def _view(row: PoolSloBudget) -> dict[str, Any]:
    return snapshot(row)


def validated(values: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults + ``values``, checked; unknown fields and bad values raise ``InvalidField``."""
    for key in values:
        if key not in DEFAULTS:
            raise InvalidField(f"unknown SLO budget field {key!r}", field=key)
    out = {**DEFAULTS, **values}
    for key in _INTEGERS:
        value = out[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidField(f"{key} must be an integer", field=key)
    for key, (maximum, unit) in _MAXIMUMS.items():
        if isinstance(out[key], int) and out[key] > maximum:
            raise InvalidField(f"{key} must be at most {maximum} {unit}, got {out[key]}", field=key)
    for key in ("hysteresis", "pilot_fraction"):
        if isinstance(out[key], int) and not isinstance(out[key], bool):
            out[key] = float(out[key])
    try:
        SloBudget(**out)
    except GuardError as exc:
        raise InvalidField(str(exc), field=exc.field) from None
    if out["window_seconds"] is None:
        raise InvalidField("window_seconds must be an integer >= 1", field="window_seconds")
    return out


def get_budget(session: Session, *, pool: int | str) -> PoolSloBudget:
    row = get_pool(session, ref=pool).slo
    if row is None:
        raise NotFound(f"pool {str(pool)[:80]!r} has no SLO budget", code="slo_budget_not_found")
    return row


def set_budget(session: Session, *, actor: str, now: datetime, pool: int | str, values: Mapping[str, Any],
               version: int | None = None) -> PoolSloBudget:
    """Create or replace the pool's budget. Replacing with ``version`` checks it (optimistic)."""
    checked = validated(values)
    with mutation(session, entity="SLO budget"):
        row = get_pool(session, ref=pool)
        existing = row.slo
        if existing is None:
            created = PoolSloBudget(**checked, created_at=now, updated_at=now, version=1)
            row.slo = created
            session.flush()
            audit.record(session, actor=actor, action=f"{ENTITY}.create", entity_type=ENTITY, entity_id=row.id,
                         before=None, after=_view(created), now=now)
            result = created
        else:
            expected = existing.version if version is None else check_version(existing, version)
            before = _view(existing)
            versioned_update(session, existing, expected_version=expected, values=checked, now=now)
            audit.record(session, actor=actor, action=f"{ENTITY}.update", entity_type=ENTITY, entity_id=row.id,
                         before=before, after=_view(existing), now=now)
            result = existing
    session.refresh(row)
    return result


def delete_budget(session: Session, *, actor: str, now: datetime, pool: int | str) -> None:
    with mutation(session, entity="SLO budget"):
        row = get_budget(session, pool=pool)
        before = _view(row)
        row.pool.slo = None  # delete-orphan: the row goes, and the pool's relationship knows it
        session.flush()
        audit.record(session, actor=actor, action=f"{ENTITY}.delete", entity_type=ENTITY, entity_id=row.pool_id,
                     before=before, after=None, now=now)


def record_guard_event(session: Session, *, actor: str, now: datetime, pool_id: int, action: str,
                       before: dict[str, Any], after: dict[str, Any]) -> None:
    """Audit a guard transition (``pool_slo.trip`` / ``pool_slo.restore``) in its own transaction."""
    with mutation(session, entity="SLO guard event"):
        audit.record(session, actor=actor, action=f"{ENTITY}.{action}", entity_type=ENTITY, entity_id=pool_id,
                     before=before, after=after, now=now)
