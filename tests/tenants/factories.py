"""Small builders for registry rows used across tests (real service calls, real DB)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from tenants import pools, retention_classes, tenant

ACTOR = "test:factory"


def now() -> datetime:
    return datetime.now(UTC)


def make_pool(session: Session, name: str = "gpu-a", **overrides: Any) -> Any:
    """A pool with one replica r0 at 127.0.0.1:8001 (legacy ``triton_url``), or ``replicas=[...]``."""
    values = dict(
        model_name="smollm2-135m",
        triton_url="127.0.0.1:8001",
        primary_blocks=128,
        secondary_blocks=256,
        secondary_offload_min_priority=35,
    )
    if "replicas" in overrides and "triton_url" not in overrides:
        del values["triton_url"]  # replicas=[...] replaces the legacy single endpoint
    values.update(overrides)
    return pools.create_pool(session, actor=ACTOR, now=now(), name=name, **values)


def make_class(session: Session, name: str = "gold", **overrides: Any) -> Any:
    return retention_classes.create_class(session, actor=ACTOR, now=now(), name=name, **overrides)


def make_tenant(
    session: Session, slug: str = "acme", *, pool: str | int = "gpu-a", cls: str | int = "gold", **overrides: Any
) -> Any:
    return tenant.create_tenant(
        session,
        actor=ACTOR,
        now=now(),
        slug=slug,
        display_name=slug.title(),
        pool=pool,
        retention_class=cls,
        **overrides,
    )


def make_placement(session: Session) -> Any:
    make_pool(session)
    make_class(session)
    return make_tenant(session)
