"""Admin routes for pools (thin: validation in schemas + services, errors via handlers)."""

from __future__ import annotations

from fastapi import APIRouter, status

from server.admin.deps import AdminActor, EngineReportsDep, NowDep, Paging, SessionDep
from server.admin.schemas import EngineReportedPublic, PageOf, PoolCreate, PoolPublic, PoolUpdate
from tenants import pools

router = APIRouter(prefix="/pools", tags=["pools"])


def public(pool, reports) -> PoolPublic:  # noqa: ANN001 - ORM row, reports callable
    """The registry row plus what its engine reported at the gateway's latest poll."""
    out = PoolPublic.model_validate(pool)
    check = reports(pool.name)
    if check is not None:
        out.engine_reported = EngineReportedPublic(
            primary_blocks=check.reported_primary, secondary_blocks=check.reported_secondary,
            tokens_per_block=check.reported_tokens_per_block, mismatch=check.mismatch)
    return out


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PoolPublic)
def create_pool(body: PoolCreate, session: SessionDep, actor: AdminActor, now: NowDep, reports: EngineReportsDep) -> PoolPublic:
    return public(pools.create_pool(session, actor=actor, now=now, **body.model_dump()), reports)


@router.get("", response_model=PageOf[PoolPublic])
def list_pools(session: SessionDep, _actor: AdminActor, page: Paging, reports: EngineReportsDep) -> PageOf[PoolPublic]:
    result = pools.list_pools(session, limit=page.limit, offset=page.offset)
    return PageOf[PoolPublic](
        items=[public(p, reports) for p in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )


@router.get("/{ref}", response_model=PoolPublic)
def get_pool(ref: str, session: SessionDep, _actor: AdminActor, reports: EngineReportsDep) -> PoolPublic:
    return public(pools.get_pool(session, ref=ref), reports)


@router.patch("/{ref}", response_model=PoolPublic)
def update_pool(ref: str, body: PoolUpdate, session: SessionDep, actor: AdminActor, now: NowDep,
                reports: EngineReportsDep) -> PoolPublic:
    changes = body.model_dump(exclude_unset=True, exclude={"version"})
    # The engine report is the latest poll's: after a change to the block counts, mismatch is
    # re-evaluated at the next poll.
    return public(pools.update_pool(session, actor=actor, now=now, ref=ref, version=body.version, changes=changes), reports)


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT)
def delete_pool(ref: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    pools.delete_pool(session, actor=actor, now=now, ref=ref)
