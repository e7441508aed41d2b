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


def outcome_answer(outcome: Outcome[Resp]) -> web.Response:
    """A fleet operation's answer, with where it spent its time: ``timings`` in the body (milliseconds per
    phase) and the same in a ``Server-Timing`` header (which browsers' and proxies' tools read)."""
    timings = outcome.timings
    if timings is None:
        return json_answer(outcome.status, outcome.answer)
    outcome.answer.timings = timings.milliseconds()
    response = json_answer(outcome.status, outcome.answer)
    response.headers["Server-Timing"] = timings.server_timing()
    return response


async def answer_when_done(request: web.Request, work: Coroutine[Any, Any, Outcome[Resp]], name: str) -> web.Response:
    """Run a fleet operation to its end even if the caller goes away (it must settle its fence, and a table
    such as the fleet's adapters must say what the workers hold), then answer with its outcome."""
    outcome = await request.app[keys.TASKS].run_detached(work, name=name)
    return outcome_answer(outcome)
