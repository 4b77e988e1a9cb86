"""Admin routes for pools (thin: validation in schemas + services, errors via handlers)."""

from __future__ import annotations

from fastapi import APIRouter, status

from server.admin.deps import AdminActor, NowDep, Paging, SessionDep
from server.admin.schemas import PageOf, PoolCreate, PoolPublic, PoolUpdate
from tenants import pools

router = APIRouter(prefix="/pools", tags=["pools"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PoolPublic)
def create_pool(body: PoolCreate, session: SessionDep, actor: AdminActor, now: NowDep) -> PoolPublic:
    return PoolPublic.model_validate(pools.create_pool(session, actor=actor, now=now, **body.model_dump()))


@router.get("", response_model=PageOf[PoolPublic])
def list_pools(session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[PoolPublic]:
    result = pools.list_pools(session, limit=page.limit, offset=page.offset)
    return PageOf[PoolPublic](
        items=[PoolPublic.model_validate(p) for p in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )


@router.get("/{ref}", response_model=PoolPublic)
def get_pool(ref: str, session: SessionDep, _actor: AdminActor) -> PoolPublic:
    return PoolPublic.model_validate(pools.get_pool(session, ref=ref))


@router.patch("/{ref}", response_model=PoolPublic)
def update_pool(ref: str, body: PoolUpdate, session: SessionDep, actor: AdminActor, now: NowDep) -> PoolPublic:
    changes = body.model_dump(exclude_unset=True, exclude={"version"})
    return PoolPublic.model_validate(
        pools.update_pool(session, actor=actor, now=now, ref=ref, version=body.version, changes=changes)
    )


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT)
def delete_pool(ref: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    pools.delete_pool(session, actor=actor, now=now, ref=ref)
