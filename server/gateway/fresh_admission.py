"""Admission under limits at most one auth TTL old when admission decides.

A request's :class:`TenantContext` is read at authentication (from the auth cache, whose
entries expire one TTL after their registry read began). Admission comes later: after the
body is parsed and the prompt tokenized, on a loaded gateway seconds later. Deciding with
the limits captured at auth would let a lowered limit (or a revoked key) admit under the old
value for that whole gap on top of the TTL.

Invariant: every lease :func:`admit` returns was decided under limits from a registry read
that began at most one auth TTL before the decision (or under the last known answer while
the registry is unreachable, as authentication itself). So once a limit change is one TTL
old, no new admission uses the old limit; requests admitted before that run to their end.
A first decision that does not stand (decided again, or the key refused) is released as never
served: the request is charged once.
"""

from __future__ import annotations

import anyio

from server.gateway.admission import Admission, Lease
from server.gateway.context import TenantContext


async def admit(admission: Admission, tenant: TenantContext, *, prompt_tokens: int,
                max_output_tokens: int | None) -> Lease:
    """Renew the tenant's limits if its snapshot is past the TTL, decide, then check again
    (the decision's round trip may have outlasted the TTL): if any limit was lowered meanwhile,
    the first decision is released (never served) and the request decided again under the new
    limits. ``max_output_tokens`` None: the request named no output limit, so it runs with the
    tenant's default as the limits decided under have it (``lease.max_output_tokens``). Raises
    :class:`AdmissionError` when refused, or the authentication's ``ServingError``
    (401/403/503) when the renewed key no longer passes."""
    current = await tenant.renewed()
    output = current.limits.default_output_tokens if max_output_tokens is None else max_output_tokens
    lease = await admission.acquire(tenant.slug, current.limits, prompt_tokens=prompt_tokens, max_output_tokens=output)
    try:
        again = await current.renewed()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await admission.release_unserved(lease)
        raise
    if again is current or not again.limits.lowers(current.limits):  # (still fresh: the same context)
        return lease
    with anyio.CancelScope(shield=True):
        await admission.release_unserved(lease)
    output = again.limits.default_output_tokens if max_output_tokens is None else max_output_tokens
    return await admission.acquire(tenant.slug, again.limits, prompt_tokens=prompt_tokens, max_output_tokens=output)
