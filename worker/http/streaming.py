"""Server-sent events for ``/generate`` with ``stream=true`` (SGLang framing).

Each chunk is ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, payload: Any) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


def client_gone(request: web.Request) -> bool:
    """True once the caller's connection is closed (aiohttp does not cancel handlers)."""
    transport = request.transport
    return transport is None or transport.is_closing()
