"""Admin routes for pools and their replicas (thin: validation in schemas + services, errors via handlers)."""

from __future__ import annotations

from fastapi import APIRouter, status

from server.admin.deps import AdminActor, NowDep, Paging, SessionDep
from server.admin.schemas import (
    PageOf,
    PoolCreate,
    PoolPublic,
    PoolUpdate,
    ReplicaCreate,
    ReplicaPublic,
    ReplicaUpdate,
    StatusChange,
)
from tenants import pools, replicas

router = APIRouter(prefix="/pools", tags=["pools"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PoolPublic)
def create_pool(body: PoolCreate, session: SessionDep, actor: AdminActor, now: NowDep) -> PoolPublic:
    values = body.model_dump(exclude={"replicas"})
    if body.replicas is not None:
        values["replicas"] = [r.model_dump() for r in body.replicas]
    return PoolPublic.model_validate(pools.create_pool(session, actor=actor, now=now, **values))


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


# --- replicas: /pools/{ref}/replicas[/{name}] --------------------------------------------------


@router.get("/{ref}/replicas", response_model=list[ReplicaPublic], tags=["replicas"])
def list_replicas(ref: str, session: SessionDep, _actor: AdminActor) -> list[ReplicaPublic]:
    return [ReplicaPublic.model_validate(r) for r in replicas.list_replicas(session, pool=ref)]


@router.post("/{ref}/replicas", status_code=status.HTTP_201_CREATED, response_model=ReplicaPublic, tags=["replicas"])
def add_replica(ref: str, body: ReplicaCreate, session: SessionDep, actor: AdminActor, now: NowDep) -> ReplicaPublic:
    return ReplicaPublic.model_validate(replicas.add_replica(session, actor=actor, now=now, pool=ref,
                                                             **body.model_dump()))


@router.get("/{ref}/replicas/{name}", response_model=ReplicaPublic, tags=["replicas"])
def get_replica(ref: str, name: str, session: SessionDep, _actor: AdminActor) -> ReplicaPublic:
    return ReplicaPublic.model_validate(replicas.get_replica(session, pool=ref, name=name))


@router.patch("/{ref}/replicas/{name}", response_model=ReplicaPublic, tags=["replicas"])
def update_replica(
    ref: str, name: str, body: ReplicaUpdate, session: SessionDep, actor: AdminActor, now: NowDep
) -> ReplicaPublic:
    changes = body.model_dump(exclude_unset=True, exclude={"version"})
    return ReplicaPublic.model_validate(
        replicas.update_replica(session, actor=actor, now=now, pool=ref, name=name, version=body.version,
                                changes=changes)
    )


@router.delete("/{ref}/replicas/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["replicas"])
def remove_replica(ref: str, name: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    """Remove a replica; a pool's last replica cannot be removed (409 ``last_replica``)."""
    replicas.remove_replica(session, actor=actor, now=now, pool=ref, name=name)


def _state_route(action: str, state: str, doc: str) -> None:
    def change(
        ref: str, name: str, session: SessionDep, actor: AdminActor, now: NowDep, body: StatusChange | None = None
    ) -> ReplicaPublic:
        version = body.version if body is not None else None
        return ReplicaPublic.model_validate(
            replicas.set_state(session, actor=actor, now=now, pool=ref, name=name, state=state, version=version)
        )

    change.__name__ = f"{action}_replica"
    change.__doc__ = doc
    router.add_api_route(
        f"/{{ref}}/replicas/{{name}}/{action}", change, methods=["POST"], response_model=ReplicaPublic,
        tags=["replicas"],
    )


_state_route("drain", "draining", "Stop sending new requests to the replica (in-flight ones finish).")
_state_route("disable", "disabled", "Take the replica out of rotation.")
_state_route("activate", "active", "Put the replica back into rotation.")
