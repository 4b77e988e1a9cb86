"""What the gateway knows about an authenticated request's tenant and pool.

A frozen snapshot taken from the registry at authentication time (and cached with the
key for the auth TTL), so a request rarely touches the database after auth: only when its
snapshot has outlived the auth TTL by the time admission decides (``renew``), so that a
lowered limit or a revoked key binds every admission decided more than one TTL after the
registry write, however long the request took to get from auth to admission.

:data:`REQUEST_ID` names the serving request the current task works for: the id every answer
of ``/v1/...`` carries in a header (``server.gateway.app.RequestIds`` sets it), so a log line
that reads it (the replica retry warning) names what a client reports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from retention.policy.hint_plan import HINTS_OFF, HintPolicy
from retention.policy.planner import RetentionClassSpec
from server.gateway.admission import Limits
from tenants.snapshots import PoolSnapshot

# ``req_`` + 24 hex chars, unique per request; None outside a /v1 request (tests, simulations).
REQUEST_ID: ContextVar[str | None] = ContextVar("kvgate_request_id", default=None)


@dataclass(frozen=True, slots=True)
class TenantContext:
    tenant_id: int
    slug: str
    status: str
    isolation: str  # shared | salted | dedicated
    cache_salt: str
    limits: Limits
    kv_quota_fraction: float
    pool: PoolSnapshot
    retention: RetentionClassSpec
    key_id: int
    retention_mode: str = "static"  # static | adaptive (retention/policy/adaptive.py)
    retention_class: str = ""  # the class's name (trace capture lines carry it)
    hints: HintPolicy = HINTS_OFF  # the class's rules for client cache hints (retention/policy/hint_plan.py)
    # The class's own switch for the conversation and tool-loop hold and the demote on delete
    # (server/gateway/api/conversation_hold.py); bounded by the hint caps above, not by ``hints.enabled``.
    conversation_hold: bool = False
    # The class's switch for the run's-end demote (server/gateway/api/conversation_demote.py): a stored,
    # tool-offering Responses run answered with a message demotes its conversation's own blocks. Independent
    # of ``conversation_hold`` and of the hold's duel.
    conversation_end_demote: bool = False
    # None while this context is still within the auth TTL of the registry read it came from
    # (and no admin write on this gateway cleared the cache since); else the same key
    # authenticated now (a 401/403/503 ServingError when that fails). None also when no
    # authenticator made this context (tests).
    renew: Callable[[], Awaitable[TenantContext | None]] | None = field(default=None, compare=False, repr=False)

    async def renewed(self) -> TenantContext:
        """This context, or the same key authenticated now when this one is past the auth TTL."""
        if self.renew is None:
            return self
        return await self.renew() or self

    @property
    def engine_tenant_id(self) -> str:
        """The id the engine attributes blocks to (stable, not secret)."""
        return str(self.tenant_id)

    @property
    def engine_salt(self) -> str | None:
        """Cache salt sent to the engine: none for ``shared`` (prefixes shared across tenants)."""
        return None if self.isolation == "shared" else self.cache_salt
