"""``POST|PUT /generate`` (SGLang ``GenerateReqInput`` semantics).

One prompt returns one ``{"text", "output_ids", "meta_info"}`` object, a batch a
list of them; with ``stream=true`` the cumulative object of each prompt is sent
as SSE chunks (``index`` added for a batch). Requests aborted by a pause or
``/abort_request`` return 200 with ``finish_reason.type == "abort"`` and their
partial output. A caller that disconnects gets its requests aborted. While the
worker shuts down a new request is a 503 at once (a router retries it elsewhere);
those already running finish, or end aborted at the shutdown grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from router.contract.errors import ApiError, Unavailable
from router.contract.generate import GenerateRequest, GenerateResponse
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.coordinator import Coordinator
from worker.engine.model_worker import ModelWorker
from worker.generation_admission import SHUTTING_DOWN
from worker.generation_handle import GenerationHandle
from worker.http.keys import ADAPTERS, COORDINATOR
from worker.http.sampling import generation_params
from worker.http.streaming import ClientGone, client_gone, event_stream, open_sse, send_event
from worker.http.wire import json_answer

POLL_S = 0.5


def prompts_of(body: GenerateRequest, worker: ModelWorker) -> list[list[int]]:
    """Token ids of every prompt, validated against the vocabulary."""
    prompts: list[list[int]]
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [worker.encode(t) for t in texts]
    else:
        ids = body.input_ids or []
        prompts = [list(p) for p in ids] if body.is_batch else [list(ids)]  # type: ignore[arg-type]
    check_prompts(prompts, worker.vocab_size, body.is_batch)
    return prompts


def check_prompts(prompts: list[list[int]], vocab: int, is_batch: bool) -> None:
    """Every prompt holds at least one token, and only ids of the vocabulary."""
    for i, ids in enumerate(prompts):
        where = f"prompt {i}" if is_batch else "the prompt"
        if not ids:
            raise ApiError(400, f"{where} is empty")
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{where} has token id {bad} outside the vocabulary [0, {vocab})")


def check_lengths(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    """SGLang's two context checks, with its messages."""
    if prompt_len >= context_len:
        raise ApiError(
            400, f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if prompt_len + max_new_tokens >= context_len:
        raise ApiError(
            400,
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens from the input messages "
            f"and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit.",
        )


async def generate(request: web.Request) -> web.StreamResponse:
    coord = request.app[COORDINATOR]
    body = await parse_body(request, GenerateRequest)
    worker = coord.worker
    adapters = request.app[ADAPTERS]
    prompts = prompts_of(body, worker)
    items = []
    for i, ids in enumerate(prompts):
        sp = body.item_sampling_params(i)
        check_lengths(len(ids), sp.max_new_tokens, worker.context_len)
        rid = body.item_rid(i)
        if rid is not None and coord.generation.rid_in_flight(rid):
            raise ApiError(400, f"a request with rid {rid!r} is already in flight")
        logprobs = (body.top_logprobs_num or 0) if body.item_return_logprob(i) else None
        params = generation_params(sp, max_new_tokens=sp.max_new_tokens, seed=sp.effective_seed, logprobs=logprobs)
        items.append((ids, params, rid, adapters.resolve(body.item_lora_path(i))))
    check_admission(coord)

    wakeup = asyncio.Event()
    handles: list[GenerationHandle] = []
    try:
        for ids, params, rid, adapter in items:
            handles.append(
                coord.generation.submit(
                    ids,
                    params,
                    rid=rid,
                    stream=body.stream,
                    return_text_in_logprobs=body.return_text_in_logprobs,
                    wakeup=wakeup,
                    adapter=adapter,
                )
            )
        if body.stream:
            return await _stream(request, coord, handles, body.is_batch, wakeup)
        return await _collect(request, coord, handles, body.is_batch, wakeup)
    finally:
        for handle in handles:
            coord.generation.release(handle)


def check_admission(coord: Coordinator) -> None:
    """Refuse a new generation the worker cannot take now (503); call it with no await before the
    submit, so nothing new slips into a shutdown's drain. A paused worker admits: requests wait."""
    if not coord.alive:
        raise ApiError(503, "the scheduler thread is not running")
    if coord.draining:
        raise Unavailable(SHUTTING_DOWN)
    why = coord.cannot_serve
    if why is not None:
        raise Unavailable(f"this worker cannot serve: {why}")


async def follow(
    request: web.Request, coord: Coordinator, handles: list[GenerationHandle], wakeup: asyncio.Event
) -> AsyncIterator[list[GenerationHandle]]:
    """Yield the handles that received output, until all have finished.

    Waits are bounded: every ``POLL_S`` it checks that the caller is still
    connected and the scheduler thread still alive.
    """
    while True:
        changed = [h for h in handles if h.drain()]
        if changed:
            yield changed
        if all(h.finished for h in handles):
            return
        try:
            await asyncio.wait_for(wakeup.wait(), POLL_S)
        except TimeoutError:
            pass
        wakeup.clear()
        if client_gone(request):
            raise ClientGone()
        if not coord.alive:
            raise ApiError(503, "the scheduler thread stopped while the request was running")
        why = coord.cannot_serve
        if why is not None:
            raise Unavailable(f"this worker can no longer serve the request: {why}")


async def _collect(
    request: web.Request, coord: Coordinator, handles: list[GenerationHandle], is_batch: bool, wakeup: asyncio.Event
) -> web.StreamResponse:
    try:
        async for _ in follow(request, coord, handles, wakeup):
            pass
    except ClientGone:
        return web.Response(status=499)
    worker = coord.worker
    outs = [h.build(worker.decode, worker.weight_version) for h in handles]
    return json_answer(outs if is_batch else outs[0])


async def _stream(
    request: web.Request, coord: Coordinator, handles: list[GenerationHandle], is_batch: bool, wakeup: asyncio.Event
) -> web.StreamResponse:
    resp = await open_sse(request)
    index = {id(h): i for i, h in enumerate(handles)}
    worker = coord.worker
    async with event_stream(resp):  # the handles are aborted by the caller's finally
        async for changed in follow(request, coord, handles, wakeup):
            for h in changed:
                await send_event(
                    resp, h.build(worker.decode, worker.weight_version, index[id(h)] if is_batch else None)
                )
    return resp


_SUMMARY = "Generate (SGLang's /generate; streams server-sent events when asked)"
ROUTES = [
    Route(method, "/generate", generate, _SUMMARY, access="generation", body=GenerateRequest, answer=GenerateResponse)
    for method in ("POST", "PUT")
]
