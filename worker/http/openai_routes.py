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
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from router.contract.errors import ApiError, error_body
from router.contract.openai import (
    LOGPROB_FLOOR,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    OpenAIRequest,
)
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.coordinator import Coordinator
from worker.engine.model_worker import ModelWorker
from worker.engine.request import GenerationParams
from worker.engine.sampling import trim_stop_string
from worker.generation import GenerationHandle
from worker.http.generate_routes import ClientGone, check_admission, check_lengths, check_prompts, follow
from worker.http.keys import COORDINATOR
from worker.http.streaming import open_sse, send_done, send_event
from worker.model.chat_template import ChatTemplateError

Kind = Literal["completion", "chat"]
_SEED_SPAN = 2**64


@dataclass(eq=False)
class _Choice:
    index: int
    prompt_index: int
    rid: str
    params: GenerationParams
    handle: GenerationHandle | None = None
    sent_text: str = ""
    sent_tokens: int = 0
    text_offset: int = 0
    closed: bool = False


@dataclass(eq=False)
class _Call:
    """One OpenAI call: its prompts, its choices and what the answer must hold."""

    kind: Kind
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    choices: list[_Choice]
    echo_texts: list[str] | None
    logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool
    include_usage: bool
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, worker: ModelWorker, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = f"token_id:{token}" if self.tokens_as_ids else worker.decode([token])
            self._token_text[token] = text
        return text


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
) -> tuple[Coordinator, _Call]:
    coord = request.app[COORDINATOR]
    worker = coord.worker
    n = body.choices_per_prompt
    base = body.rid or uuid.uuid4().hex
    total = len(prompts) * n
    choices: list[_Choice] = []
    for p, ids in enumerate(prompts):
        wanted = body.max_new_tokens
        max_new = wanted if wanted is not None else max(worker.context_len - len(ids) - 1, 0)
        check_lengths(len(ids), max_new, worker.context_len)
        for j in range(n):
            index = p * n + j
            rid = base if total == 1 else f"{base}-{index}"
            if coord.rid_in_flight(rid):
                raise ApiError(400, f"a request with rid {rid!r} is already in flight")
            params = GenerationParams(
                max_new_tokens=max_new,
                min_new_tokens=min(body.min_tokens, max_new),
                temperature=body.effective_temperature,
                top_p=body.effective_top_p,
                top_k=body.effective_top_k,
                min_p=body.effective_min_p,
                stop_strings=tuple(body.stop_strings()),
                stop_token_ids=frozenset(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                no_stop_trim=body.include_stop_str_in_output,
                seed=_choice_seed(body.seed, j),
                return_logprob=logprobs is not None,
                top_logprobs_num=logprobs or 0,
            )
            offset = len(echo_texts[p]) if echo_texts is not None else 0
            choices.append(_Choice(index=index, prompt_index=p, rid=rid, params=params, text_offset=offset))
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    call = _Call(
        kind=kind,
        id=f"{prefix}-{base}",
        created=int(time.time()),
        model=worker.served_model_name,
        prompts=prompts,
        choices=choices,
        echo_texts=echo_texts,
        logprobs=logprobs,
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        include_usage=body.include_usage,
    )
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
    return await _run(request, coord, call, stream=bool(body.stream))


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
    return await _run(request, coord, call, stream=bool(body.stream))


async def _run(request: web.Request, coord: Coordinator, call: _Call, *, stream: bool) -> web.StreamResponse:
    check_admission(coord)  # no await between this and the submits
    wakeup = asyncio.Event()
    submitted: list[GenerationHandle] = []
    try:
        for choice in call.choices:
            choice.handle = coord.submit(
                call.prompts[choice.prompt_index], choice.params, rid=choice.rid, stream=stream, wakeup=wakeup
            )
            submitted.append(choice.handle)
        if stream:
            return await _stream(request, coord, call, submitted, wakeup)
        return await _collect(request, coord, call, submitted, wakeup)
    finally:
        for handle in submitted:
            coord.release(handle)


# -- answers --------------------------------------------------------------------------------------


def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _finish(choice: _Choice) -> tuple[str | None, int | str | None]:
    """OpenAI's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or stop token; None for EOS)."""
    h = choice.handle
    assert h is not None
    reason = h.finish_reason
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        matched = reason.get("matched")
        if isinstance(matched, int) and matched not in choice.params.stop_token_ids:
            matched = None
        return "stop", matched
    if kind == "length":
        return "length", None
    return "abort", None


def _visible_text(worker: ModelWorker, choice: _Choice) -> str:
    """The choice's text so far, without what might still change: the start of a stop string or a
    character whose bytes have not all arrived (both only while the choice runs)."""
    h = choice.handle
    assert h is not None
    text = worker.decode(h.output_ids)
    if h.finished:
        return trim_stop_string(text, h.finish_reason, h.params.no_stop_trim)
    hold = len(text) - len(text.rstrip("\ufffd"))
    if not h.params.no_stop_trim:
        for stop in h.params.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
    return text[: len(text) - hold] if hold else text


def _completion_logprobs(worker: ModelWorker, call: _Call, choice: _Choice, start: int, end: int) -> dict[str, Any]:
    h = choice.handle
    assert h is not None
    tokens, values, tops, offsets = [], [], [], []
    for i in range(start, end):
        tok = h.output_ids[i]
        text = call.token_text(worker, tok)
        value = _logprob(h.logprobs[i]) if i < len(h.logprobs) else None
        tokens.append(text)
        values.append(value)
        top: dict[str, float] = {}
        if call.logprobs and i < len(h.top_logprobs):
            top = {call.token_text(worker, t): _logprob(lp) for lp, t in h.top_logprobs[i]}
        if value is not None:
            top.setdefault(text, value)
        tops.append(top)
        offsets.append(choice.text_offset)
        choice.text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(worker: ModelWorker, call: _Call, choice: _Choice, start: int, end: int) -> dict[str, Any]:
    h = choice.handle
    assert h is not None

    def entry(token: int, value: float) -> dict[str, Any]:
        text = call.token_text(worker, token)
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for i in range(start, min(end, len(h.logprobs))):
        item = entry(h.output_ids[i], h.logprobs[i])
        rows = h.top_logprobs[i] if call.logprobs and i < len(h.top_logprobs) else []
        item["top_logprobs"] = [entry(t, lp) for lp, t in rows]
        content.append(item)
    return {"content": content, "refusal": None}


def _logprobs_of(worker: ModelWorker, call: _Call, choice: _Choice, start: int, end: int) -> dict[str, Any] | None:
    if call.logprobs is None:
        return None
    if call.kind == "completion":
        return _completion_logprobs(worker, call, choice, start, end)
    return _chat_logprobs(worker, call, choice, start, end)


def _usage(call: _Call) -> dict[str, int]:
    prompt = sum(len(p) for p in call.prompts)
    completion = sum(len(c.handle.output_ids) for c in call.choices if c.handle is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _envelope(call: _Call, worker: ModelWorker, chunk: bool) -> dict[str, Any]:
    objects = {
        "completion": ("text_completion", "text_completion"),
        "chat": ("chat.completion", "chat.completion.chunk"),
    }
    obj = objects[call.kind][chunk]
    version = worker.weight_version
    return {
        "id": call.id,
        "object": obj,
        "created": call.created,
        "model": call.model,
        "weight_version": version,
        "metadata": {"weight_version": version},
    }


def _response(call: _Call, worker: ModelWorker) -> dict[str, Any]:
    choices = []
    for choice in call.choices:
        h = choice.handle
        assert h is not None
        text = _visible_text(worker, choice)
        finish, stop = _finish(choice)
        logprobs = _logprobs_of(worker, call, choice, 0, len(h.output_ids))
        item: dict[str, Any] = {"index": choice.index}
        if call.kind == "completion":
            echo = call.echo_texts[choice.prompt_index] if call.echo_texts is not None else ""
            item["text"] = echo + text
        else:
            item["message"] = {"role": "assistant", "content": text}
        item.update(logprobs=logprobs, finish_reason=finish, stop_reason=stop)
        if call.return_token_ids:
            item["token_ids"] = list(h.output_ids)
            if call.kind == "completion":
                item["prompt_token_ids"] = call.prompts[choice.prompt_index]
        choices.append(item)
    out = _envelope(call, worker, chunk=False)
    out["choices"] = choices
    out["usage"] = _usage(call)
    if call.return_token_ids and call.kind == "chat":
        out["prompt_token_ids"] = call.prompts[0]
    return out


async def _collect(
    request: web.Request, coord: Coordinator, call: _Call, handles: list[GenerationHandle], wakeup: asyncio.Event
) -> web.StreamResponse:
    try:
        async for _ in follow(request, coord, handles, wakeup):
            pass
    except ClientGone:
        return web.Response(status=499)
    return web.json_response(_response(call, coord.worker))


def _chunk(call: _Call, worker: ModelWorker, choices: list[dict[str, Any]]) -> dict[str, Any]:
    out = _envelope(call, worker, chunk=True)
    out["choices"] = choices
    if call.include_usage:
        out["usage"] = None
    return out


def _delta(call: _Call, worker: ModelWorker, choice: _Choice) -> dict[str, Any] | None:
    """The chunk entry for what ``choice`` produced since the last one, or None when nothing shows yet."""
    h = choice.handle
    assert h is not None
    text = _visible_text(worker, choice)
    delta = text[len(choice.sent_text) :] if len(text) > len(choice.sent_text) else ""
    start, end = choice.sent_tokens, len(h.output_ids)
    finish, stop = _finish(choice)
    wants_tokens = call.logprobs is not None or call.return_token_ids
    if not delta and finish is None and not (wants_tokens and end > start):
        return None
    if delta:
        choice.sent_text = text
    choice.sent_tokens = end
    item: dict[str, Any] = {"index": choice.index}
    if call.kind == "completion":
        item["text"] = delta
    else:
        item["delta"] = {"content": delta} if delta else {}
    item.update(logprobs=_logprobs_of(worker, call, choice, start, end), finish_reason=finish)
    if finish is not None:
        item["stop_reason"] = stop
        choice.closed = True
    if call.return_token_ids:
        item["token_ids"] = h.output_ids[start:end]
    return item


def _opening(call: _Call, choice: _Choice) -> dict[str, Any] | None:
    """The first entry of a choice: the assistant role (chat), the echoed prompt (completions with echo)."""
    if call.kind == "chat":
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    if call.echo_texts is not None:
        entry: dict[str, Any] = {
            "index": choice.index,
            "text": call.echo_texts[choice.prompt_index],
            "logprobs": None,
            "finish_reason": None,
        }
        if call.return_token_ids:
            entry["prompt_token_ids"] = call.prompts[choice.prompt_index]
        return entry
    return None


async def _stream(
    request: web.Request, coord: Coordinator, call: _Call, handles: list[GenerationHandle], wakeup: asyncio.Event
) -> web.StreamResponse:
    resp = await open_sse(request)
    worker = coord.worker
    by_handle = {id(c.handle): c for c in call.choices}
    try:
        for choice in call.choices:
            opening = _opening(call, choice)
            if opening is not None:
                await send_event(resp, _chunk(call, worker, [opening]))
        async for changed in follow(request, coord, handles, wakeup):
            for handle in changed:
                choice = by_handle[id(handle)]
                if choice.closed:
                    continue
                item = _delta(call, worker, choice)
                if item is not None:
                    await send_event(resp, _chunk(call, worker, [item]))
        if call.include_usage:
            last = _envelope(call, worker, chunk=True)
            last.update(choices=[], usage=_usage(call))
            await send_event(resp, last)
        await send_done(resp)
    except (ClientGone, ConnectionResetError):
        pass  # the handles are aborted by the caller's finally
    except ApiError as exc:
        try:
            await send_event(resp, error_body(exc.message))
            await send_done(resp)
        except ConnectionResetError:
            pass
    return resp


# -- models ---------------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    worker = request.app[COORDINATOR].worker
    card = {
        "id": worker.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "omni-worker",
        "root": worker.model_path,
        "max_model_len": worker.context_len,
    }
    return web.json_response({"object": "list", "data": [card]})


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
