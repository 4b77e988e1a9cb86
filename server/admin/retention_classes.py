"""Admin routes for retention classes."""

from __future__ import annotations

from fastapi import APIRouter, status

from server.admin.deps import AdminActor, NowDep, Paging, SessionDep
from server.admin.schemas import PageOf, RetentionClassCreate, RetentionClassPublic, RetentionClassUpdate
from tenants import retention_classes as classes

router = APIRouter(prefix="/retention-classes", tags=["retention classes"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=RetentionClassPublic)
def create_class(
    body: RetentionClassCreate, session: SessionDep, actor: AdminActor, now: NowDep
) -> RetentionClassPublic:
    return RetentionClassPublic.model_validate(classes.create_class(session, actor=actor, now=now, **body.model_dump()))


@router.get("", response_model=PageOf[RetentionClassPublic])
def list_classes(session: SessionDep, _actor: AdminActor, page: Paging) -> PageOf[RetentionClassPublic]:
    result = classes.list_classes(session, limit=page.limit, offset=page.offset)
    return PageOf[RetentionClassPublic](
        items=[RetentionClassPublic.model_validate(c) for c in result.items],
        total=result.total,
        limit=result.limit,
        offset=result.offset,
    )


@router.get("/{ref}", response_model=RetentionClassPublic)
def get_class(ref: str, session: SessionDep, _actor: AdminActor) -> RetentionClassPublic:
    return RetentionClassPublic.model_validate(classes.get_class(session, ref=ref))


@router.patch("/{ref}", response_model=RetentionClassPublic)
def update_class(
    ref: str, body: RetentionClassUpdate, session: SessionDep, actor: AdminActor, now: NowDep
) -> RetentionClassPublic:
    changes = body.model_dump(exclude_unset=True, exclude={"version"})
    return RetentionClassPublic.model_validate(
        classes.update_class(session, actor=actor, now=now, ref=ref, version=body.version, changes=changes)
    )


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT)
def delete_class(ref: str, session: SessionDep, actor: AdminActor, now: NowDep) -> None:
    classes.delete_class(session, actor=actor, now=now, ref=ref)
