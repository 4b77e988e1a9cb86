"""Admin routes for a tenant's API keys. The plaintext is in the create response only."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from server.admin.deps import AdminActor, NowDep, Paging, SessionDep, SettingsDep
from server.admin.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, PageOf
from tenants import keys

router = APIRouter(prefix="/tenants/{ref}/keys", tags=["api keys"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ApiKeyCreated)
def create_key(
    ref: str, body: ApiKeyCreate, session: SessionDep, actor: AdminActor, now: NowDep, settings: SettingsDep
) -> ApiKeyCreated:
    row, plaintext = keys.create_key(
        session,
        actor=actor,
        now=now,
        tenant=ref,
        name=body.name,
        expires_at=body.expires_at,
        pepper=settings.effective_key_pepper(),
    )
    return ApiKeyCreated(**ApiKeyPublic.model_validate(row).model_dump(), key=plaintext)


@router.get("", response_model=PageOf[ApiKeyPublic])
def list_keys(ref: str, session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[ApiKeyPublic]:
    result = keys.list_keys(session, tenant=ref, limit=page.limit, offset=page.offset)
    return PageOf[ApiKeyPublic](
        items=[ApiKeyPublic.model_validate(k) for k in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )


@router.post("/{key_id}/revoke", response_model=ApiKeyPublic)
def revoke_key(
    ref: str, key_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: SessionDep, actor: AdminActor, now: NowDep
) -> ApiKeyPublic:
    return ApiKeyPublic.model_validate(keys.revoke_key(session, actor=actor, now=now, tenant=ref, key_id=key_id))
