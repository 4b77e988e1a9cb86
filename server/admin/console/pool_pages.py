"""The pool pages: the list (paged), a pool's replicas (drain / activate), KV, SLO guard and captures (paged)."""

from __future__ import annotations

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
    api_form_error,
    form_error,
    number,
    pager,
    q,
)

CAPTURE_FIELDS = ("sample_rate", "tenant")
CAPTURES_PAGE = 20  # a pool's captures on its page, newest first: a daily capture over years is thousands


def register(app: FastAPI, console: Console) -> None:
    ask, maybe, page = console.ask, console.maybe, console.page

    @app.get("/pools", response_class=HTMLResponse)
    async def pools(request: Request, offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
                    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE_SIZE) -> Response:
        session = console.session_of(request)
        listing, error = await maybe(request, session, "/pools", limit=limit, offset=offset)
        if error is not None:
            return console.failed(request, session, error)
        rows = []
        for pool in listing["items"]:
            kv, _ = await maybe(request, session, f"/pools/{q(pool['name'])}/kv")
            guard, _ = await maybe(request, session, f"/pools/{q(pool['name'])}/slo/state")
            rows.append({"pool": pool, "kv": kv, "guard": guard})
        paging = pager("/pools", offset=offset, limit=limit, total=listing["total"], shown=len(rows))
        return page(request, session, "pools.html", rows=rows, paging=paging)

    async def pool_live(request: Request, session: ConsoleSession, name: str) -> dict[str, Any]:
        ref = q(name)
        pool = await ask(request, session, "GET", f"/pools/{ref}")
        kv, kv_error = await maybe(request, session, f"/pools/{ref}/kv")
        live = {r["name"]: r for r in (kv or {}).get("replicas", [])}
        chart = charts.miss_ratio_chart([(name, "pool", kv["mrc"])], title=f"Miss-ratio curve of pool {name}") \
            if kv is not None else None
        return {"pool": pool, "kv": kv, "kv_error": kv_error, "live": live, "kv_chart": chart}

    async def pool_context(request: Request, session: ConsoleSession, name: str, *, offset: int = 0,
                           limit: int = CAPTURES_PAGE) -> dict[str, Any]:
        context = await pool_live(request, session, name)
        ref = q(name)
        budget, budget_error = await maybe(request, session, f"/pools/{ref}/slo")
        guard, guard_error = await maybe(request, session, f"/pools/{ref}/slo/state")
        trips, _ = await maybe(request, session, "/audit", entity_type="pool_slo",
                               entity_id=str(context["pool"]["id"]), limit=20)
        listing, captures_error = await maybe(request, session, f"/pools/{ref}/captures", limit=limit, offset=offset)
        captures = listing["items"] if listing is not None else []
        paging = pager(f"/pools/{ref}", offset=offset, limit=limit, total=listing["total"], shown=len(captures)) \
            if listing is not None else None
        return {"budget": budget, "budget_error": budget_error, "guard": guard, "guard_error": guard_error,
                "trips": (trips or {}).get("items", []), "captures": captures, "captures_paging": paging,
                "captures_error": captures_error, "form": None, "form_error": None, **context}

    @app.get("/pools/{name}", response_class=HTMLResponse)
    async def pool(request: Request, name: str, offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
                   limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = CAPTURES_PAGE) -> Response:
        session = console.session_of(request)
        try:
            context = await pool_context(request, session, name, offset=offset, limit=limit)
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "pool.html", **context)

    @app.get("/pools/{name}/live", response_class=HTMLResponse)
    async def pool_live_fragment(request: Request, name: str) -> Response:
        session = console.session_of(request)
        try:
            context = await pool_live(request, session, name)
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "_pool_live.html", fragment=True, **context)

    @app.post("/pools/{name}/replicas/{replica}/state")
    async def replica_state(request: Request, name: str, replica: str) -> Response:
        session, form = await console.posted(request)
        state = form.get("state", "")
        try:
            version = int(form.get("version", ""))
        except ValueError:
            return console.back(session, f"/pools/{q(name)}", "error", "version must be a number")
        try:
            await ask(request, session, "PATCH", f"/pools/{q(name)}/replicas/{q(replica)}",
                      json={"version": version, "state": state})
        except ApiFailure as exc:
            return console.back(session, f"/pools/{q(name)}", "error", f"Replica {replica} unchanged: {exc}")
        return console.back(session, f"/pools/{q(name)}", "ok", f"Replica {replica} is now {state}.")

    @app.post("/pools/{name}/slo/restore")
    async def slo_restore(request: Request, name: str) -> Response:
        session, _form = await console.posted(request)
        try:
            await ask(request, session, "POST", f"/pools/{q(name)}/slo/restore")
        except ApiFailure as exc:
            return console.back(session, f"/pools/{q(name)}", "error", f"Not restored: {exc}")
        return console.back(session, f"/pools/{q(name)}", "ok", "Host tier restored.")

    @app.post("/pools/{name}/captures")
    async def start_capture(request: Request, name: str) -> Response:
        session, form = await console.posted(request)
        values = {k: form.get(k, "").strip() for k in CAPTURE_FIELDS}
        body: dict[str, Any] = {"tenant": values["tenant"]} if values["tenant"] else {}
        error = None
        if values["sample_rate"]:
            try:
                body["sample_rate"] = number(values["sample_rate"], float)
            except ValueError:
                error = form_error("Capture not started", 422, "sample rate must be a number", field="sample_rate")
        if error is None:
            try:
                created = await ask(request, session, "POST", f"/pools/{q(name)}/captures", json=body)
            except ApiFailure as exc:
                error = api_form_error("Capture not started", exc, CAPTURE_FIELDS)
            else:
                return console.back(session, f"/pools/{q(name)}", "ok", f"Capture {created['id']} started.")
        # Refused: the pool page again, the form as typed, the reason next to its field.
        try:
            context = await pool_context(request, session, name)
        except ApiFailure as exc:
            return console.failed(request, session, exc)
        return page(request, session, "pool.html", status=error["status"], **{**context, "form": values,
                                                                               "form_error": error})

    @app.post("/pools/{name}/captures/{capture_id}/stop")
    async def stop_capture(request: Request, name: str, capture_id: str) -> Response:
        session, _form = await console.posted(request)
        try:
            await ask(request, session, "POST", f"/pools/{q(name)}/captures/{q(capture_id)}/stop")
        except ApiFailure as exc:
            return console.back(session, f"/pools/{q(name)}", "error", f"Capture not stopped: {exc}")
        return console.back(session, f"/pools/{q(name)}", "ok", f"Capture {capture_id} stopped.")
