"""``GET /health`` and ``GET /health_generate`` (open even when admin auth is on)."""

from __future__ import annotations

from aiohttp import web

from worker.http.keys import COORDINATOR


async def health(request: web.Request) -> web.Response:
    """200 while the process serves, paused or not; 503 once the scheduler thread is gone."""
    coord = request.app[COORDINATOR]
    if not coord.alive:
        return web.json_response({"status": "unhealthy", "message": "the scheduler thread is not running"}, status=503)
    return web.json_response({"status": "ok", "is_paused": coord.is_paused})


async def health_generate(request: web.Request) -> web.Response:
    """A one-token generation. While generation is paused (or memory released) it
    answers 200 at once with a note, rather than SGLang's 20 s wait ending in 503."""
    coord = request.app[COORDINATOR]
    ok, message = await coord.health_generate()
    return web.json_response({"status": "ok" if ok else "unhealthy", "message": message}, status=200 if ok else 503)


ROUTES = [
    web.get("/health", health),
    web.get("/health_generate", health_generate),
]
