"""OpenAI-compatible routes through the router: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Completions and chat completions go through the same :class:`~router.gateway.routing.proxy.GenerateProxy`
as ``/generate``, only to another worker path: the policy picks among routable workers (healthy,
enabled, not pending: a worker fenced by an update gets none), a failure before the first byte
is retried on another worker, streams pass through, and a caller that disconnects has its
request aborted on the worker (the proxy gives the body a ``rid`` when it has none; the worker
names a call's choices ``rid-0``, ``rid-1``, ... and aborts by that prefix). Bodies pass through
untouched, so a caller's mistake is the worker's 400.

``GET /v1/models`` asks every routable worker for its models and answers their union (by id),
503 with the reason when none is routable or none answered. A model listing is a model-metadata
read: each worker gets as long as ``/model_info``'s budget gives the router.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.errors import Unavailable
from router.contract.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from router.contract.web.openapi import Route
from router.gateway import keys
from router.gateway.api.proxied import proxied
from router.gateway.fleet.registry import Worker
from router.gateway.routing.proxied import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH
from router.gateway.routing.proxy import describe_fleet
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"


async def _models_of(workers: WorkerClient, worker: Worker, headers: dict[str, str]) -> ModelList | None:
    answer = await workers.fetch(
        worker.url, MODELS_PATH, ModelList, headers=headers, timeout_s=ep.MODEL_INFO.budget.router_wait()
    )
    if answer.value is None:
        log.info("%s%s: %s", worker.id, MODELS_PATH, answer.error or f"answered {answer.status}")
    return answer.value


async def models(request: web.Request) -> web.Response:
    app = request.app
    registry = app[keys.REGISTRY]
    routable = registry.routable()
    if not routable:
        raise Unavailable(describe_fleet(registry))
    headers = {k: v for k, v in app[keys.SERVICE_HEADERS].items() if k != "Content-Type"}
    answers = await asyncio.gather(*(_models_of(app[keys.WORKERS], w, headers) for w in routable))
    cards: dict[str, dict[str, Any]] = {}
    for answer in answers:
        if answer is None:
            continue
        for card in answer.data:
            cards.setdefault(card.id, card.model_dump(exclude_none=True))
    if not any(a is not None for a in answers):
        raise Unavailable(f"none of the {len(routable)} routable worker(s) listed its models")
    return web.json_response({"object": "list", "data": list(cards.values())})


def routes() -> list[Route]:
    return [
        Route(
            "GET",
            MODELS_PATH,
            models,
            "The models the routable workers serve (OpenAI's /v1/models)",
            access="generation",
            answer=ModelList,
        ),
        Route(
            "POST",
            COMPLETIONS_PATH,
            proxied,
            "Complete prompts on one routable worker (OpenAI's /v1/completions; streams when asked)",
            access="generation",
            body=CompletionRequest,
            answer=CompletionResponse,
        ),
        Route(
            "POST",
            CHAT_COMPLETIONS_PATH,
            proxied,
            "Answer a chat on one routable worker (OpenAI's /v1/chat/completions; streams when asked)",
            access="generation",
            body=ChatCompletionRequest,
            answer=ChatCompletionResponse,
        ),
    ]
