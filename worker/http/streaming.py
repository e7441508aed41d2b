"""Server-sent events for ``stream=true`` (SGLang's and OpenAI's framing).

Each chunk is ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from aiohttp import web
from pydantic import BaseModel

from router.contract.errors import ApiError, error_body
from worker.http.wire import sse_event

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, payload: BaseModel | Mapping[str, object]) -> None:
    await resp.write(sse_event(payload))


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


def client_gone(request: web.Request) -> bool:
    """True once the caller's connection is closed (aiohttp does not cancel handlers)."""
    transport = request.transport
    return transport is None or transport.is_closing()


class ClientGone(Exception):
    """The caller closed the connection."""


@contextlib.asynccontextmanager
async def event_stream(resp: web.StreamResponse) -> AsyncIterator[None]:
    """Send the events written inside, then ``[DONE]``. A caller that went away ends the stream
    quietly (its requests are aborted by the handler); an error after the first event can no
    longer change the status, so it is sent as a last event before ``[DONE]``."""
    try:
        yield
        await send_done(resp)
    except (ClientGone, ConnectionResetError):
        pass
    except ApiError as exc:
        with contextlib.suppress(ConnectionResetError):
            await send_event(resp, error_body(exc.message))
            await send_done(resp)
