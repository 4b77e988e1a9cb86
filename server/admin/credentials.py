"""Admin routes for admin credentials and ``whoami``. Thin: rules in ``tenants.admin_credentials``,
who may call what in ``server.admin.permissions``. The plaintext secret is in the create and
rotate responses only."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from server.admin.deps import AdminActor, IdentityDep, NowDep, Paging, SessionDep, SettingsDep
from server.admin.schemas import Name, PageOf, Strict
from tenants import admin_credentials as service
from tenants.models import AdminCredential

router = APIRouter(tags=["admin credentials"])
Role = Literal["platform-admin", "operator", "tenant-admin", "viewer"]
CredentialId = Annotated[int, Path(ge=1, le=2**31 - 1)]


class WhoAmI(BaseModel):
    name: str
    role: Role
    tenants: list[str] | None = Field(description="tenant slugs the caller is scoped to; null = unscoped")


class CredentialCreate(Strict):
    name: str = Field(min_length=1, max_length=128)
    role: Role
    tenants: list[Name] | None = Field(
        None, min_length=1, max_length=1000,
        description="required for tenant-admin, optional for viewer, refused for platform-admin and operator")
    expires_at: datetime | None = Field(None, description="timezone-aware; null = never")


class CredentialRotate(Strict):
    overlap_seconds: int = Field(strict=True, ge=0, le=service.MAX_OVERLAP_SECONDS,
                                 description="how long the current secret stays valid beside the new one")


class CredentialPublic(BaseModel):
    id: int
    name: str
    role: Role
    tenants: list[str] | None
    prefix: str
    expires_at: datetime | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class CredentialCreated(CredentialPublic):
    secret: str = Field(description="the plaintext kva_<prefix>_<secret>; shown once, never retrievable again")


def credential_public(session: Session, row: AdminCredential, scope: list[str] | None = None) -> CredentialPublic:
    tenants = scope if scope is not None else (service.scope_of(session, row.id) if row.scoped else None)
    return CredentialPublic(id=row.id, name=row.name, role=row.role, tenants=tenants, prefix=row.prefix,  # type: ignore[arg-type]
                            expires_at=row.expires_at, created_at=row.created_at, last_used_at=row.last_used_at,
                            revoked_at=row.revoked_at)


@router.get("/whoami", response_model=WhoAmI)
def whoami(identity: IdentityDep) -> WhoAmI:
    """The caller's name, role and tenant scope."""
    return WhoAmI(name=identity.name, role=identity.role,  # type: ignore[arg-type]
                  tenants=list(identity.tenants) if identity.tenants is not None else None)


@router.post("/credentials", status_code=status.HTTP_201_CREATED, response_model=CredentialCreated)
def create_credential(body: CredentialCreate, session: SessionDep, actor: AdminActor, now: NowDep,
                      settings: SettingsDep) -> CredentialCreated:
    row, scope, secret = service.create_credential(
        session, actor=actor, now=now, name=body.name, role=body.role, tenants=body.tenants,
        expires_at=body.expires_at, pepper=settings.effective_key_pepper())
    return CredentialCreated(**credential_public(session, row, scope).model_dump(), secret=secret)


@router.get("/credentials", response_model=PageOf[CredentialPublic])
def list_credentials(session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[CredentialPublic]:
    result = service.list_credentials(session, limit=page.limit, offset=page.offset)
    return PageOf[CredentialPublic](items=[credential_public(session, r) for r in result.items], total=result.total,
                                    limit=result.limit, offset=result.offset)


@router.get("/credentials/{credential_id}", response_model=CredentialPublic)
def get_credential(credential_id: CredentialId, session: SessionDep, _actor: AdminActor) -> CredentialPublic:
    return credential_public(session, service.get_credential(session, credential_id=credential_id))


@router.delete("/credentials/{credential_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_credential(credential_id: CredentialId, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    """Revoke at once on every gateway (credentials are read from the registry per request)."""
    service.revoke_credential(session, actor=actor, now=now, credential_id=credential_id)


@router.post("/credentials/{credential_id}/rotate", status_code=status.HTTP_201_CREATED,
             response_model=CredentialCreated)
def rotate_credential(credential_id: CredentialId, body: CredentialRotate, session: SessionDep, actor: AdminActor,
                      now: NowDep, settings: SettingsDep) -> CredentialCreated:
    """A new secret; the current one is accepted ``overlap_seconds`` more, then refused (409 if revoked)."""
    row, secret = service.rotate_credential(session, actor=actor, now=now, credential_id=credential_id,
                                            overlap_seconds=body.overlap_seconds,
                                            pepper=settings.effective_key_pepper())
    return CredentialCreated(**credential_public(session, row).model_dump(), secret=secret)
