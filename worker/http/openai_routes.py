"""OpenAI-compatible generation: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

The same engine path as ``/generate``: each choice (``n`` per prompt) is one request submitted
through the coordinator, so the same rules hold: while generation is paused requests wait; while
the weights are not whole the call is a 503 at once; a caller that disconnects has its requests
aborted; a pause with ``abort`` ends them with ``finish_reason: "abort"`` and their partial text.

Chat messages are rendered with the checkpoint's chat template
(:mod:`worker.model.chat_template`) and tokenized without adding special tokens; a checkpoint
without one answers 400. Completion prompts are tokenized as ``/generate`` tokenizes ``text``, so
a greedy completion equals ``/generate``'s output for the same prompt.

Answers follow OpenAI's shapes, with ``finish_reason`` ``stop`` | ``length`` | ``abort`` and
vLLM's ``stop_reason``; ``weight_version`` sits at the top level and in ``metadata``. Streaming
sends ``data: {chunk}`` events (text held back while it could still become a stop string or an
incomplete character) and ``data: [DONE]``; with ``stream_options.include_usage`` the last chunk
has no choices and carries ``usage``. With a ``seed``, choice ``j`` of a prompt samples with
``seed + j`` (vLLM's rule), so ``n > 1`` gives different samples and each is reproducible.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from router.contract.errors import ApiError
from router.contract.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
)
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.coordinator import Coordinator
from worker.generation_handle import GenerationHandle
from worker.http import openai_answers as answers
from worker.http.generate_routes import check_admission, check_lengths, check_prompts, follow
from worker.http.keys import ADAPTERS, COORDINATOR
from worker.http.openai_calls import Call, Choice, Kind
from worker.http.sampling import Sampling, generation_params
from worker.http.streaming import ClientGone, event_stream, open_sse, send_event
from worker.http.wire import json_answer
from worker.model.chat_template import ChatTemplateError

_SEED_SPAN = 2**64


# -- building a call ----------------------------------------------------------------------------


def _choice_seed(seed: int | None, j: int) -> int | None:
    if seed is None or j == 0:
        return seed
    return (seed + j) % _SEED_SPAN


def _plan(
    request: web.Request,
    body: OpenAIRequest,
    kind: Kind,
    prompts: list[list[int]],
    *,
    logprobs: int | None,
    echo_texts: list[str] | None,
) -> tuple[Coordinator, Call]:
    base = body.rid or uuid.uuid4().hex
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    served = request.app[COORDINATOR].worker.served_model_name
    adapter = request.app[ADAPTERS].for_model(body.model, served)
    return plan_call(
        request,
        body,
        Call(
            kind=kind,
            id=f"{prefix}-{base}",
            created=int(time.time()),
            model=served if adapter is None else adapter.name,
            prompts=prompts,
            choices=[],
            echo_texts=echo_texts,
            logprobs=logprobs,
            return_token_ids=bool(body.return_token_ids),
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            include_usage=body.include_usage,
            adapter=adapter,
        ),
        rid=base,
    )


def plan_call(request: web.Request, sampling: Sampling, call: Call, *, rid: str) -> tuple[Coordinator, Call]:
    """Fill ``call`` with ``sampling.choices_per_prompt`` choices per prompt, each one engine request
    (``rid``, or ``rid-<index>`` when the call has several), checked against the context and the
    requests in flight."""
    coord = request.app[COORDINATOR]
    worker = coord.worker
    n = sampling.choices_per_prompt
    total = len(call.prompts) * n
    for p, ids in enumerate(call.prompts):
        wanted = sampling.max_new_tokens
        max_new = wanted if wanted is not None else max(worker.context_len - len(ids) - 1, 0)
        check_lengths(len(ids), max_new, worker.context_len)
        for j in range(n):
            index = p * n + j
            choice_rid = rid if total == 1 else f"{rid}-{index}"
            if coord.generation.rid_in_flight(choice_rid):
                raise ApiError(400, f"a request with rid {choice_rid!r} is already in flight")
            params = generation_params(
                sampling, max_new_tokens=max_new, seed=_choice_seed(sampling.seed, j), logprobs=call.logprobs
            )
            offset = len(call.echo_texts[p]) if call.echo_texts is not None else 0
            call.choices.append(Choice(index=index, prompt_index=p, rid=choice_rid, params=params, text_offset=offset))
    return coord, call


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    worker = request.app[COORDINATOR].worker
    raw = body.prompts()
    prompts = [worker.encode(p) if isinstance(p, str) else list(p) for p in raw]
    check_prompts(prompts, worker.vocab_size, len(prompts) > 1)
    echo_texts = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else worker.decode(list(p)) for p in raw]
    coord, call = _plan(request, body, "completion", prompts, logprobs=body.logprobs, echo_texts=echo_texts)
    return await run_call(request, coord, call, stream=bool(body.stream))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionRequest)
    worker = request.app[COORDINATOR].worker
    try:
        template = worker.chat_template.require()
        text = template.render(
            [m.template_view() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            tools=body.tools,
            extra=body.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc)) from None
    prompt = worker.encode(text, add_special_tokens=False)
    check_prompts([prompt], worker.vocab_size, False)
    logprobs = body.top_logprobs_num if body.logprobs else None
    coord, call = _plan(request, body, "chat", [prompt], logprobs=logprobs, echo_texts=None)
    return await run_call(request, coord, call, stream=bool(body.stream))


async def run_call(request: web.Request, coord: Coordinator, call: Call, *, stream: bool) -> web.StreamResponse:
    check_admission(coord)  # no await between this and the submits
    wakeup = asyncio.Event()
    submitted: list[GenerationHandle] = []
    try:
        for choice in call.choices:
            choice.handle = coord.generation.submit(
                call.prompts[choice.prompt_index],
                choice.params,
                rid=choice.rid,
                stream=stream,
                wakeup=wakeup,
                adapter=call.adapter,
            )
            submitted.append(choice.handle)
        if stream:
            return await _stream(request, coord, call, submitted, wakeup)
        return await _collect(request, coord, call, submitted, wakeup)
    finally:
        for handle in submitted:
            coord.generation.release(handle)


async def _collect(
    request: web.Request, coord: Coordinator, call: Call, handles: list[GenerationHandle], wakeup: asyncio.Event
) -> web.StreamResponse:
    try:
        async for _ in follow(request, coord, handles, wakeup):
            pass
    except ClientGone:
        return web.Response(status=499)
    return json_answer(answers.response_body(call, coord.worker))


async def _stream(
    request: web.Request, coord: Coordinator, call: Call, handles: list[GenerationHandle], wakeup: asyncio.Event
) -> web.StreamResponse:
    resp = await open_sse(request)
    worker = coord.worker
    by_handle = {id(c.handle): c for c in call.choices}
    async with event_stream(resp):  # the handles are aborted by the caller's finally
        for choice in call.choices:
            opening = answers.opening(call, worker, choice)
            if opening is not None:
                await send_event(resp, opening)
        async for changed in follow(request, coord, handles, wakeup):
            for handle in changed:
                choice = by_handle[id(handle)]
                if choice.closed:
                    continue
                event = answers.delta(call, worker, choice)
                if event is not None:
                    await send_event(resp, event)
        if call.include_usage:
            await send_event(resp, answers.usage_chunk(call, worker))
    return resp


# -- models ---------------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    worker = request.app[COORDINATOR].worker
    card = ModelCard(
        id=worker.served_model_name,
        object="model",
        created=int(time.time()),
        owned_by="omni-worker",
        root=worker.model_path,
        max_model_len=worker.context_len,
    )
    adapters = request.app[ADAPTERS]
    # As vLLM and SGLang list them: each loaded adapter a model of its own, its parent the base.
    cards = [card] + [
        ModelCard(
            id=name,
            object="model",
            created=card.created,
            owned_by="omni-worker",
            root=source,
            parent=card.id,
            max_model_len=worker.context_len,
        )
        for name, source in adapters.loaded().items()
    ]
    return json_answer(ModelList(object="list", data=cards))


ROUTES = [
    Route("GET", "/v1/models", models, "The served model (OpenAI's /v1/models)", access="generation", answer=ModelList),
    Route(
        "POST",
        "/v1/completions",
        completions,
        "Complete prompts (OpenAI's /v1/completions; streams server-sent events when asked)",
        access="generation",
        body=CompletionRequest,
        answer=CompletionResponse,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        chat_completions,
        "Answer a chat with the checkpoint's chat template (OpenAI's /v1/chat/completions; streams when asked)",
        access="generation",
        body=ChatCompletionRequest,
        answer=ChatCompletionResponse,
    ),
]
