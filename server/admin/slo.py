"""Admin routes for a pool's SLO guard: the budget (registry) and the live state (gateway).

* ``GET/PUT/DELETE /pools/{ref}/slo`` — the pool's budget (``tenants.slo``); PUT sets it
  as a whole (fields not given take their defaults), audited as ``pool_slo.*``.
* ``GET /pools/{ref}/slo/state`` — this gateway process's guard: tripped or not, since
  when, why, the window's p99s, and the pilot arms side by side.
* ``POST /pools/{ref}/slo/restore`` — restore the host tier at once (audited as
  ``pool_slo.restore`` with the admin as actor).

The state lives in the gateway process (``server.gateway.observe.slo_guard``), installed on this
app as ``app.state.slo_guard``; an admin API served without a gateway answers 404
``no_gateway`` there. Each gateway replica guards on its own traffic, and a restarted one
starts untripped. The guard is the pool's (by id): a renamed pool's state answers under its
new name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, status
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from server.admin.deps import AdminActor, NowDep, SessionDep
from server.errors import ApiError
from tenants import pools, slo

router = APIRouter(prefix="/pools", tags=["slo"])

BudgetMs = Annotated[int | None, Field(strict=True, ge=1, le=slo.MAX_BUDGET_MS,
                                       description="p99 budget in ms; null = not guarded")]
Seconds = Annotated[int, Field(strict=True, le=slo.MAX_SECONDS)]


class SloBudgetSet(BaseModel):
    """The whole budget; fields not given take their defaults."""

    model_config = ConfigDict(extra="forbid")

    ttft_p99_ms: BudgetMs = None
    itl_p99_ms: BudgetMs = None
    window_seconds: Annotated[Seconds, Field(ge=1, description="how long the budget must stay broken to trip")] = 60
    min_requests: Annotated[int, Field(strict=True, ge=1, le=slo.MAX_MIN_REQUESTS,
                                      description="samples needed in the window (at most what it keeps)")] = 20
    cooldown_seconds: Annotated[Seconds, Field(ge=0, description="time tripped before an automatic restore")] = 300
    hysteresis: Annotated[float, Field(strict=True, ge=0, lt=1, description="restore below budget x (1 - h)")] = 0.2
    enabled: StrictBool = True
    pilot_fraction: Annotated[float, Field(strict=True, ge=0, le=1, description="share of tenants with the host tier")] = 1.0
    version: Annotated[int | None, Field(strict=True, description="replace only this version (optional)")] = None


class SloBudgetPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    pool_id: int
    ttft_p99_ms: int | None
    itl_p99_ms: int | None
    window_seconds: int
    min_requests: int
    cooldown_seconds: int
    hysteresis: float
    enabled: bool
    pilot_fraction: float
    version: int
    created_at: datetime
    updated_at: datetime


@router.get("/{ref}/slo", response_model=SloBudgetPublic)
def get_budget(ref: str, session: SessionDep, _actor: AdminActor) -> SloBudgetPublic:
    return SloBudgetPublic.model_validate(slo.get_budget(session, pool=ref))


@router.put("/{ref}/slo", response_model=SloBudgetPublic)
def set_budget(ref: str, body: SloBudgetSet, session: SessionDep, actor: AdminActor, now: NowDep) -> SloBudgetPublic:
    values = body.model_dump(exclude={"version"})
    return SloBudgetPublic.model_validate(
        slo.set_budget(session, actor=actor, now=now, pool=ref, values=values, version=body.version)
    )


@router.delete("/{ref}/slo", status_code=status.HTTP_204_NO_CONTENT)
def delete_budget(ref: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    slo.delete_budget(session, actor=actor, now=now, pool=ref)


def _guard(request: Request):  # type: ignore[no-untyped-def]
    guard = getattr(request.app.state, "slo_guard", None)
    if guard is None:
        raise ApiError(404, "no_gateway", "this process serves no gateway, so it has no SLO guard state")
    return guard


@router.get("/{ref}/slo/state")
def guard_state(ref: str, request: Request, session: SessionDep, _actor: AdminActor) -> dict[str, Any]:
    """The guard's state in this gateway process (see ``server.gateway.observe.slo_guard.SloGuards.view``)."""
    guard = _guard(request)
    pool = pools.get_pool(session, ref=ref)
    return guard.view(pool.name, pool_id=pool.id)


@router.post("/{ref}/slo/restore")
async def restore(ref: str, request: Request, session: SessionDep, actor: AdminActor) -> dict[str, Any]:
    """Restore the pool's host tier now (a no-op when not tripped); returns the new state."""
    guard = _guard(request)
    pool = pools.get_pool(session, ref=ref)
    name, pool_id = pool.name, pool.id
    session.close()  # the audit event is written by the guard in its own session
    await guard.admin_restore(name, actor=actor, pool_id=pool_id)
    return guard.view(name, pool_id=pool_id)
