"""One log line per call a router's admin operation sends this worker, under the operation's id.

A router names every admin operation (:data:`~router.contract.admin.OPERATION_HEADER`) on each call it
sends; the worker logs the call's route, status and duration with that id, so one ``grep`` of the id
follows an update across the router's log and every worker's. Calls without the header (health probes,
generation) are not logged here.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from router.contract.admin import OPERATION_HEADER

log = logging.getLogger("worker.admin")


@web.middleware
async def operation_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    operation = request.headers.get(OPERATION_HEADER)
    if operation is None:
        return await handler(request)
    start = time.perf_counter()
    status: int | str = "error"
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        # The id is printed as the router sent it; %r keeps a strange one from forging a line.
        log.info("admin %r %s %s: %s in %.0f ms", operation, request.method, request.path, status, elapsed_ms)
