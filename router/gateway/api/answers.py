"""How the admin handlers answer: a typed body as JSON, and a fleet operation run to its end first."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

from router.contract.base import WireResponse
from router.gateway import keys
from router.gateway.admin.answers import Outcome

Resp = TypeVar("Resp", bound=WireResponse)


def json_answer(status: int, body: WireResponse) -> web.Response:
    return web.Response(body=body.model_dump_json(), status=status, content_type="application/json")


async def answer_when_done(request: web.Request, work: Coroutine[Any, Any, Outcome[Resp]], name: str) -> web.Response:
    """Run a fleet operation to its end even if the caller goes away (it must settle its fence, and a table
    such as the fleet's adapters must say what the workers hold), then answer with its outcome."""
    outcome = await request.app[keys.TASKS].run_detached(work, name=name)
    return json_answer(outcome.status, outcome.answer)
