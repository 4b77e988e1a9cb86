"""The kvgate web console, mounted at ``/console`` beside the admin API.

Server-rendered pages (Jinja2) over the admin API only: each page calls ``/admin/v1``
with the signed-in user's credential (``api.py``), so what a user may see or change is
decided by the API; the console merely hides what the user's role cannot do. htmx
(vendored in ``static/``) refreshes the live KV and replica panels; every form works
without it. Security: a strict CSP with no inline script or style, a synchronizer CSRF
token on every POST, server-side sessions behind an HttpOnly SameSite=Strict cookie
(``sessions.py``). Layout: ``pages.py`` builds the app (headers, error pages, sign-in),
``tenant_pages.py`` and ``pool_pages.py`` hold the pages, ``web.py`` what they share.
See docs/architecture.md, "Console".
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.admin.console.pages import CONSOLE_PREFIX, build

__all__ = ["CONSOLE_PREFIX", "create_console_app"]


def create_console_app(*, api_app: Any, idle_s: float = 1800.0, max_age_s: float = 12 * 3600.0) -> FastAPI:
    """The console sub-app; ``api_app`` is the ASGI app whose ``/admin/v1`` it calls (the parent app)."""
    return build(api_app=api_app, idle_s=idle_s, max_age_s=max_age_s)
