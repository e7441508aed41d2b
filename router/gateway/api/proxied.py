"""aiohttp's handler of the routes proxied to one worker (their table: :mod:`router.gateway.routing.proxied`)."""

from __future__ import annotations

from aiohttp import web

from router.gateway import keys
from router.gateway.routing.caller import AiohttpCaller
from router.gateway.routing.proxied import PROXIED


async def proxied(request: web.Request) -> web.StreamResponse:
    """aiohttp's handler of every route in :data:`~router.gateway.routing.proxied.PROXIED`."""
    route = PROXIED[request.match_info.route.resource.canonical]  # type: ignore[union-attr]  # routed: never None
    return await request.app[keys.PROXY].handle(AiohttpCaller(request), route.worker_path, route.prepare)
