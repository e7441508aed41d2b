"""``GET /dashboard``: a read-only page of the fleet, for an operator's browser.

The page is three static files kept as package data (``router/gateway/dashboard/``): the HTML
shell, one script and one style sheet. It shows what ``omni-router status`` shows (the workers, the
journal's entry with how to resolve it, the fleet's recorded versions) and a timeline of the
version each worker served, refreshed every 2 s (docs/dashboard.md).

Access: the three files are **open** routes, and they hold no data. A browser cannot send an
``Authorization`` header when it navigates to a URL, so a page behind the admin key could not be
opened at all; instead everything the page shows is read by its script with ``fetch()`` from the
routes that already guard it, with the admin key the operator types in once (kept in the tab's
``sessionStorage``, sent as ``Authorization: Bearer <key>``): ``GET /fleet/status`` (an admin route: every
worker with the router's own verdict, the journal and the fleet's versions) and ``GET /health`` (open). A
router without an admin key answers those without one, and the page asks for none. For tests and
scripted screenshots a key may be handed in the URL's fragment (``/dashboard#key=...``): a
fragment never reaches the server or its logs, and the page removes it from the address bar.

Every answer carries a strict Content-Security-Policy (scripts, styles and requests from the
router's own origin only; no inline script or style; not framed), so the page loads nothing from
elsewhere, and every URL in it is relative: it works unchanged through ``kubectl port-forward``.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from router.contract.web.openapi import Handler, Route

PATH = "/dashboard"
#: The package that holds the page's files.
ASSETS = "router.gateway.dashboard"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
#: Each file of the page: its route, the file and its media type.
FILES = (
    (PATH, "index.html", "text/html"),
    (f"{PATH}/dashboard.js", "dashboard.js", "text/javascript"),
    (f"{PATH}/dashboard.css", "dashboard.css", "text/css"),
)


def asset(name: str) -> bytes:
    """One of the page's files, as installed with the package."""
    return resources.files(ASSETS).joinpath(name).read_bytes()


def _serve(name: str, media_type: str) -> Handler:
    body = asset(name)  # read once, when the route table is built

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=media_type, charset="utf-8", headers=HEADERS)

    return serve


def routes() -> list[Route]:
    summary = {
        "index.html": "The fleet page (no data: it reads the admin routes with the key typed into it)",
        "dashboard.js": "The fleet page's script",
        "dashboard.css": "The fleet page's style sheet",
    }
    return [
        Route("GET", path, _serve(name, media_type), summary[name], access="open", media_type=media_type)
        for path, name, media_type in FILES
    ]
