"""``GET /health``, ``GET /liveness`` and ``GET /health_generate`` (open even when admin auth is on).

``/health`` is the readiness signal (a router's probe, a Kubernetes ``readinessProbe``): 503
``draining`` from the moment the process is asked to shut down. ``/liveness`` is the
``livenessProbe``: 200 as long as the process serves, draining included, so that Kubernetes
does not kill a worker that is finishing its requests."""

from __future__ import annotations

from aiohttp import web

from router.contract.admin import HealthStatus
from router.contract.web.openapi import Route
from worker.generation_admission import SHUTTING_DOWN
from worker.http.keys import COORDINATOR, VLLM_TRANSFER, WEIGHT_SYNC


async def health(request: web.Request) -> web.Response:
    """200 while the process serves, paused or not; 503 once the scheduler thread is gone.

    It also says which weights the process holds (version, state, instance): a router reads
    them with every probe, so a worker that restarted or holds partial weights is taken out
    of routing at the first probe that sees it; and the state of a prepared update's
    receive (and whether a vLLM update is open), so that a router can end an update no worker
    can complete any more. 503 ``draining``
    while the worker shuts down: it finishes what it runs and takes nothing new."""
    coord = request.app[COORDINATOR]
    if not coord.alive:
        return web.json_response({"status": "unhealthy", "message": "the scheduler thread is not running"}, status=503)
    status = HealthStatus(
        status="draining" if coord.draining else "ok",
        is_paused=coord.is_paused,
        weight_version=coord.worker.weight_version,
        weight_state=coord.weight_state,
        instance_id=coord.instance_id,
        receive=request.app[WEIGHT_SYNC].receive_state,  # type: ignore[arg-type]
        weight_update="open" if request.app[VLLM_TRANSFER].update_open else None,
    )
    if coord.draining:
        return web.json_response({**status.model_dump(), "message": SHUTTING_DOWN}, status=503)
    return web.json_response(status.model_dump())


async def liveness(request: web.Request) -> web.Response:
    """200 while the process serves, draining or not; 503 once the scheduler thread is gone."""
    coord = request.app[COORDINATOR]
    if not coord.alive:
        return web.json_response({"status": "unhealthy", "message": "the scheduler thread is not running"}, status=503)
    return web.json_response({"status": "draining" if coord.draining else "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """A one-token generation. While generation is paused (or memory released) it
    answers 200 at once with a note, rather than SGLang's 20 s wait ending in 503."""
    coord = request.app[COORDINATOR]
    if coord.draining:
        return web.json_response({"status": "draining", "message": SHUTTING_DOWN}, status=503)
    ok, message = await coord.health_generate()
    return web.json_response({"status": "ok" if ok else "unhealthy", "message": message}, status=200 if ok else 503)


ROUTES = [
    Route("GET", "/health", health, "The process serves; which weights it holds", access="open", answer=HealthStatus),
    Route("GET", "/liveness", liveness, "The process serves (draining included)", access="open"),
    Route("GET", "/health_generate", health_generate, "A one-token generation", access="open"),
]
