"""The tenant pages: the list (paged, with a slug filter), creation, a tenant's limits, usage,
API keys (paged) and live KV."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response

from server.admin.console import charts
from server.admin.console.api import ApiFailure
from server.admin.console.sessions import ConsoleSession
from server.admin.console.web import (
    MAX_OFFSET,
    MAX_PAGE,
    PAGE_SIZE,
    Console,
    SignInRequired,
    api_form_error,
    form_error,
    number,
    pager,
    q,
)

TENANT_FIELDS = ("slug", "display_name", "pool", "retention_class", "isolation", "kv_quota_fraction", "rpm_limit",
                 "tpm_limit", "max_concurrent_requests")
NUMBERS: tuple[tuple[str, type[int] | type[float]], ...] = (
    ("kv_quota_fraction", float), ("rpm_limit", int), ("tpm_limit", int), ("max_concurrent_requests", int))
SEARCH_SCAN = 10_000  # tenants a filter reads, at most (the admin API lists; it does not search)

Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]


def register(app: FastAPI, console: Console) -> None:
    ask, maybe, page = console.ask, console.maybe, console.page

    async def search(request: Request, session: ConsoleSession, needle: str) -> tuple[list[Any], bool]:
        """Tenants whose slug contains ``needle`` among the first SEARCH_SCAN, and whether that
        stopped short of the end (an exact slug is still found, by its own page)."""
        found: list[Any] = []
        scanned, total = 0, 0
        while scanned < SEARCH_SCAN:
            listing = await ask(request, session, "GET", "/tenants", limit=MAX_PAGE, offset=scanned)
            total = listing["total"]
            found += [t for t in listing["items"] if needle in t["slug"]]
            scanned += len(listing["items"])
            if not listing["items"] or scanned >= total:
                break
        truncated = scanned < total
        if truncated and not any(t["slug"] == needle for t in found):
            exact, _ = await maybe(request, session, f"/tenants/{q(needle)}")
            if exact is not None:
                found.insert(0, exact)
        return found, truncated

    async def tenants_context(request: Request, session: ConsoleSession, *, offset: int = 0, limit: int = PAGE_SIZE,
                              needle: str = "") -> dict[str, Any]:
        truncated = False
        if needle:
            found, truncated = await search(request, session, needle)
            rows, total = found[offset:offset + limit], len(found)
        else:
            listing = await ask(request, session, "GET", "/tenants", limit=limit, offset=offset)
            rows, total = listing["items"], listing["total"]
        pools = classes = []
        if console.can(session, "tenant.create"):
            pools = await console.every(request, session, "/pools")
            classes = await console.every(request, session, "/retention-classes")
        return {"tenants": rows, "total": total, "needle": needle, "truncated": truncated, "scan": SEARCH_SCAN,
                "paging": pager("/tenants", offset=offset, limit=limit, total=total, shown=len(rows), q=needle),
                "pools": pools, "classes": classes}

    @app.get("/tenants", response_class=HTMLResponse)
    async def tenants(request: Request, offset: Offset = 0, limit: Limit = PAGE_SIZE,
                      needle: Annotated[str, Query(alias="q", max_length=64)] = "") -> Response:
        session = console.session_of(request)
        try:
            context = await tenants_context(request, session, offset=offset, limit=limit, needle=needle.strip().lower())
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "tenants.html", form=None, form_error=None, **context)

    @app.post("/tenants")
    async def create_tenant(request: Request) -> Response:
        session, form = await console.posted(request)
        values = {k: form.get(k, "").strip() for k in TENANT_FIELDS}
        body: dict[str, Any] = {k: values[k] for k in ("slug", "display_name", "pool", "retention_class", "isolation")
                                if values[k]}
        error = None
        for name, kind in NUMBERS:
            if values[name]:
                try:
                    body[name] = number(values[name], kind)
                except ValueError:
                    error = form_error("Tenant not created", 422, f"{name} must be a number", field=name)
                    break
        if error is None:
            try:
                created = await ask(request, session, "POST", "/tenants", json=body)
            except ApiFailure as exc:
                error = api_form_error("Tenant not created", exc, TENANT_FIELDS)
            else:
                return console.back(session, f"/tenants/{q(created['slug'])}", "ok", f"Tenant {created['slug']} created.")
        # Refused: the form again, as typed, with the reason next to its field.
        try:
            context = await tenants_context(request, session)
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "tenants.html", status=error["status"], form=values, form_error=error, **context)

    async def tenant_context(request: Request, session: ConsoleSession, slug: str, *, offset: int = 0,
                             limit: int = PAGE_SIZE, strict: bool = True) -> dict[str, Any]:
        """The tenant page's data. Not ``strict``: what the API still answers, the parts it refuses left
        out (the tenant itself too: ``tenant`` None), for a page that must be shown anyway."""
        ref = q(slug)

        async def get(path: str, **kw: Any) -> Any:
            return await ask(request, session, "GET", path, **kw) if strict else \
                (await maybe(request, session, path, **kw))[0]

        tenant = await get(f"/tenants/{ref}")
        if tenant is None:
            return {"tenant": None, "slug": slug}
        keys = paging = None  # the operator role may not read keys: no card
        listing = await get(f"/tenants/{ref}/keys", limit=limit, offset=offset) \
            if console.can(session, "key.read") else None
        if listing is not None:
            keys = listing["items"]
            paging = pager(f"/tenants/{ref}", offset=offset, limit=limit, total=listing["total"], shown=len(keys))
        # On a minute start: the API rounds a bound inside a minute up, which would leave out the
        # first of the last 24 h's minutes.
        since = (datetime.now(UTC) - timedelta(days=1)).replace(second=0, microsecond=0).isoformat()
        usage, usage_error = await maybe(request, session, f"/tenants/{ref}/usage", limit=60, **{"from": since})
        return {"tenant": tenant, "keys": keys, "keys_paging": paging, "usage": usage, "usage_error": usage_error,
                **await kv_context(request, session, slug)}

    async def kv_context(request: Request, session: ConsoleSession, slug: str) -> dict[str, Any]:
        kv, kv_error = await maybe(request, session, f"/tenants/{q(slug)}/kv")
        chart = bars = None
        if kv is not None:
            bars = charts.blocks_chart(
                [("GPU (primary)", kv["primary_blocks"], kv["quota_blocks"], kv["pool_primary_blocks"]),
                 ("host (secondary)", kv["secondary_blocks"], None, kv["pool_secondary_blocks"])],
                title=f"KV blocks held by {slug}")
            chart = charts.miss_ratio_chart([(slug, "tenant", kv["mrc"])], title=f"Miss-ratio curve of {slug}")
        return {"slug": slug, "kv": kv, "kv_error": kv_error, "kv_bars": bars, "kv_chart": chart}

    @app.get("/tenants/{slug}", response_class=HTMLResponse)
    async def tenant(request: Request, slug: str, offset: Offset = 0, limit: Limit = PAGE_SIZE) -> Response:
        session = console.session_of(request)
        try:
            context = await tenant_context(request, session, slug, offset=offset, limit=limit)
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "tenant.html", new_key=None, **context)

    @app.get("/tenants/{slug}/kv", response_class=HTMLResponse)
    async def tenant_kv(request: Request, slug: str) -> Response:
        session = console.session_of(request)
        return page(request, session, "_tenant_kv.html", fragment=True, **await kv_context(request, session, slug))

    @app.post("/tenants/{slug}/keys")
    async def create_key(request: Request, slug: str) -> Response:
        session, form = await console.posted(request)
        try:
            created = await ask(request, session, "POST", f"/tenants/{q(slug)}/keys",
                                json={"name": form.get("name", "").strip()[:128]})
        except ApiFailure as exc:
            return console.back(session, f"/tenants/{q(slug)}", "error", f"Key not created: {exc}")
        # The key exists, and its secret is in this response only (not in a redirect, a flash or the
        # session): if reloading the page fails, the page still shows it, with what could be loaded.
        try:
            context = await tenant_context(request, session, slug)
        except (ApiFailure, SignInRequired) as exc:
            session.flash("error", f"Key {created.get('name') or created['prefix']} was created (its secret is "
                                   f"below), but the page could not be refreshed: {exc}")
            context = {"tenant": None, "slug": slug}  # signed out (the API answered 401): ask nothing more
            if isinstance(exc, ApiFailure):
                try:
                    context = await tenant_context(request, session, slug, strict=False)
                except SignInRequired:
                    pass
        return page(request, session, "tenant.html", status=201, new_key=created, **context)

    @app.post("/tenants/{slug}/keys/{key_id}/revoke")
    async def revoke_key(request: Request, slug: str, key_id: int) -> Response:
        session, _form = await console.posted(request)
        try:
            await ask(request, session, "POST", f"/tenants/{q(slug)}/keys/{key_id}/revoke")
        except ApiFailure as exc:
            if exc.status in (403, 404):  # not this credential's tenant or key: the API's refusal, as is
                return console.failed(request, session, exc)
            return console.back(session, f"/tenants/{q(slug)}", "error", f"Key not revoked: {exc}")
        return console.back(session, f"/tenants/{q(slug)}", "ok", f"Key {key_id} revoked.")
