"""Admin read routes for live KV figures: ``GET /tenants/{ref}/kv`` and ``GET /pools/{ref}/kv``.

The registry knows limits and quotas; only the gateway process knows what the engines
hold. These routes read the gateway's latest engine poll and its miss-ratio curves
(``server.gateway.kv_view``, installed as ``app.state.kv_view``): per tenant, the blocks
it holds per tier, its share of its KV quota, its block hit rate from the engines'
per-request KV metrics and its miss-ratio curve; per pool, the tiers, the engine
counters, the replicas' breaker state and the pool's curve. An admin API served without
a gateway answers 404 ``no_gateway``; each gateway replica reports its own view.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.admin.deps import AdminActor, SessionDep
from server.errors import ApiError
from tenants import pools
from tenants import tenant as tenant_service

router = APIRouter(tags=["kv"])


class CurvePointPublic(BaseModel):
    gpu: str  # capacity scale of the GPU tier, e.g. "0.5x", "1x"
    host: str
    primary_blocks: int
    secondary_blocks: int
    hit_rate: float | None  # estimated prompt-token hit rate; null before any sampled block
    hit_rate_stderr: float | None
    host_hit_rate: float | None


class TenantKvPublic(BaseModel):
    tenant: str
    pool: str
    polled: bool  # false until the gateway's first stats poll of the pool answered
    engine_up: bool | None
    primary_blocks: int
    secondary_blocks: int
    pool_primary_blocks: int | None
    pool_secondary_blocks: int | None
    quota_blocks: float | None  # primary blocks allowed by kv_quota_fraction
    quota_share: float | None  # primary blocks held / quota_blocks
    demoted: bool  # new blocks planned at the lowest priority while over quota
    requests: int  # requests whose engine response carried KV metrics (this process)
    reused_blocks: int
    new_blocks: int
    onboarded_blocks: int
    hit_rate: float | None  # reused / (reused + new)
    host_hit_share: float | None  # onboarded / reused
    pool_hit_rate: float | None
    mrc: list[CurvePointPublic]


class TierPublic(BaseModel):
    used_blocks: int
    free_blocks: int
    max_blocks: int


class ReplicaLivePublic(BaseModel):
    name: str
    state: str  # registry state
    breaker: str  # closed | open | half_open
    healthy: bool
    in_flight: int
    indexed: str  # precise | approximate | unknown
    reporting: bool


class TenantBlocksPublic(BaseModel):
    tenant: str
    primary_blocks: int
    secondary_blocks: int


class PoolKvPublic(BaseModel):
    pool: str
    polled: bool
    engine_up: bool | None
    tiers: dict[str, TierPublic] | None
    cache_hit_rate: float | None
    counters: dict[str, int] | None
    tenants: list[TenantBlocksPublic]
    replicas: list[ReplicaLivePublic]
    mrc: list[CurvePointPublic]


def _view(request: Request) -> Any:
    view = getattr(request.app.state, "kv_view", None)
    if view is None:
        raise ApiError(404, "no_gateway", "this process serves no gateway, so it has no live KV figures")
    return view


@router.get("/tenants/{ref}/kv", response_model=TenantKvPublic)
def tenant_kv(ref: str, request: Request, session: SessionDep, _actor: AdminActor) -> TenantKvPublic:
    tenant = tenant_service.get_tenant(session, ref=ref)
    pool, _cls = tenant_service.placement(session, tenant=tenant)
    figures = _view(request).tenant(pool=pool.name, tenant_id=tenant.id, slug=tenant.slug,
                                    kv_quota_fraction=tenant.kv_quota_fraction)
    return TenantKvPublic(tenant=tenant.slug, pool=pool.name, **figures)


@router.get("/pools/{ref}/kv", response_model=PoolKvPublic)
def pool_kv(ref: str, request: Request, session: SessionDep, _actor: AdminActor) -> PoolKvPublic:
    pool = pools.get_pool(session, ref=ref)
    return PoolKvPublic(pool=pool.name, **_view(request).pool(pool.name))
