"""vLLM's token routes: ``POST /inference/v1/generate`` (tokens in, tokens out), ``/tokenize``, ``/detokenize``.

``/inference/v1/generate`` runs on the OpenAI routes' engine path (:func:`worker.http.openai_routes.plan_call`
and :func:`~worker.http.openai_routes.run_call`): each of the ``n`` choices is one request submitted
through the coordinator, so requests wait while generation is paused, a worker whose weights are
not whole answers 503 at once, a caller that disconnects has its requests aborted, and a pause in
``abort`` mode (or ``/abort_requests``) ends them with ``finish_reason: "abort"`` and the tokens so
far. Its requests run as ``generate-tokens-<id>`` (``-<j>`` per choice when ``n`` > 1), the id the
answer carries and ``/abort_requests`` takes. A greedy answer equals ``/generate``'s ``output_ids``
for the same ids. The wire messages are :mod:`router.contract.vllm_tokens`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from router.contract.errors import ApiError
from router.contract.vllm_tokens import (
    DETOKENIZE_PATH,
    GENERATE_PATH,
    REQUEST_ID_HEADER,
    REQUEST_ID_PREFIX,
    TOKENIZE_PATH,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokensGenerateRequest,
    TokensGenerateResponse,
)
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.http.generate_routes import check_prompts
from worker.http.keys import ADAPTERS, COORDINATOR
from worker.http.openai_calls import Call
from worker.http.openai_routes import plan_call, run_call
from worker.model.chat_template import ChatTemplateError

#: Text or ids longer than this are (de)tokenized on a thread, not on the event loop.
OFF_LOOP_ITEMS = 4096

T = TypeVar("T")


async def _off_loop(fn: Callable[[], T], size: int) -> T:
    return fn() if size <= OFF_LOOP_ITEMS else await asyncio.to_thread(fn)


def _request_id(request: web.Request, body: TokensGenerateRequest) -> str:
    """vLLM's ``generate-tokens-<X-Request-Id header | request_id | a new id>``."""
    base = request.headers.get(REQUEST_ID_HEADER) or body.request_id or uuid.uuid4().hex
    if len(base) > 256:
        raise ApiError(400, f"{REQUEST_ID_HEADER} is longer than 256 characters")
    return f"{REQUEST_ID_PREFIX}{base}"


async def generate_tokens(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, TokensGenerateRequest, allow_empty=False)
    worker = request.app[COORDINATOR].worker
    prompt = list(body.token_ids)
    check_prompts([prompt], worker.vocab_size, False)
    sampling = body.sampling_params
    request_id = _request_id(request, body)
    adapter = request.app[ADAPTERS].for_model(body.model, worker.served_model_name)
    call = Call(
        kind="tokens",
        id=request_id,
        created=int(time.time()),
        model=worker.served_model_name if adapter is None else adapter.name,
        adapter=adapter,
        prompts=[prompt],
        choices=[],
        echo_texts=None,
        logprobs=sampling.logprobs,
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=True,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )
    coord, call = plan_call(request, sampling, call, rid=request_id)
    return await run_call(request, coord, call, stream=bool(body.stream))


async def tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenizeRequest, allow_empty=False)
    worker = request.app[COORDINATOR].worker
    text = body.prompt
    if body.messages is not None:
        try:
            text = worker.chat_template.require().render(
                [m.template_view() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                tools=body.tools,
                extra=body.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc)) from None
    assert text is not None
    special = body.special_tokens
    ids = await _off_loop(lambda: worker.encode(text, add_special_tokens=special), len(text))
    strs = None
    if body.return_token_strs:
        strs = await _off_loop(lambda: [worker.tokenizer.id_to_token(t) for t in ids], len(ids))
    answer = TokenizeResponse(count=len(ids), max_model_len=worker.context_len, tokens=ids, token_strs=strs)
    return web.json_response(answer.model_dump(mode="json"))


async def detokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, DetokenizeRequest, allow_empty=False)
    worker = request.app[COORDINATOR].worker
    bad = next((t for t in body.tokens if t >= worker.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {worker.vocab_size})")
    ids = list(body.tokens)
    text = await _off_loop(lambda: worker.decode(ids), len(ids))
    return web.json_response(DetokenizeResponse(prompt=text).model_dump(mode="json"))


ROUTES = [
    Route(
        "POST",
        GENERATE_PATH,
        generate_tokens,
        "Generate from token ids, answer token ids (vLLM's token-in/token-out route; streams when asked)",
        access="generation",
        body=TokensGenerateRequest,
        answer=TokensGenerateResponse,
    ),
    Route(
        "POST",
        TOKENIZE_PATH,
        tokenize,
        "Token ids of a prompt, or of chat messages rendered with the chat template (vLLM)",
        access="generation",
        body=TokenizeRequest,
        answer=TokenizeResponse,
    ),
    Route(
        "POST",
        DETOKENIZE_PATH,
        detokenize,
        "The text of token ids (vLLM)",
        access="generation",
        body=DetokenizeRequest,
        answer=DetokenizeResponse,
    ),
]
