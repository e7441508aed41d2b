"""The bodies of OpenAI-compatible answers: whole responses, streamed chunks, logprobs and usage.

Built from a :class:`~worker.http.openai_calls.Call` as its requests progress, as the contract's
models (:mod:`router.contract.openai`, :mod:`router.contract.openai_stream`; a ``tokens`` call's
in :mod:`worker.http.tokens_answers`); the routes in :mod:`worker.http.openai_routes` and
:mod:`worker.http.tokens_routes` submit the requests and send what is built here
(:mod:`worker.http.wire`: a field left unset is absent, not null).

Key presence follows vLLM's OpenAI server: every choice carries ``logprobs`` and ``finish_reason``
(null until known); ``stop_reason`` is on every whole answer's choice and on a streamed choice's
last chunk; ``token_ids`` (and a completion's ``prompt_token_ids``, a chat answer's top-level
``prompt_token_ids``) only with ``return_token_ids``. The answer's ``weight_version`` (top level and
``metadata``, a flat string map as OpenAI's schema wants) is the version that sampled the call's
newest token, or the served one before any token.
"""

from __future__ import annotations

from typing import Any

from router.contract.openai import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FinishReasonName,
    ResponseMetadata,
    TokenLogprob,
    TopLogprob,
)
from router.contract.openai_stream import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from router.contract.vllm_tokens import TokensGenerateResponse, TokensStreamResponse
from worker.engine.model_worker import ModelWorker
from worker.http import tokens_answers
from worker.http.openai_calls import Call, Choice, finish, logprob, spans, usage, visible_text, weight_version

Answer = CompletionResponse | ChatCompletionResponse | TokensGenerateResponse
#: A streamed event: a completion streams ``Completion`` objects (OpenAI's shape), a chat its chunks.
Chunk = CompletionResponse | ChatCompletionChunk | TokensStreamResponse


# -- logprobs -------------------------------------------------------------------------------------


def _completion_logprobs(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> CompletionLogprobs:
    h = choice.running
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for i in range(start, end):
        text = call.token_text(worker, h.output_ids[i])
        value = logprob(h.logprobs[i]) if i < len(h.logprobs) else None
        tokens.append(text)
        values.append(value)
        top: dict[str, float] = {}
        if call.logprobs and i < len(h.top_logprobs):
            top = {call.token_text(worker, t): logprob(lp) for lp, t in h.top_logprobs[i]}
        if value is not None:
            top.setdefault(text, value)
        tops.append(top)
        offsets.append(choice.text_offset)
        choice.text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def _chat_logprobs(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> ChatLogprobs:
    h = choice.running

    def entry(token: int, value: float) -> TopLogprob:
        text = call.token_text(worker, token)
        return TopLogprob(token=text, logprob=logprob(value), bytes=list(text.encode("utf-8")))

    content = []
    for i in range(start, min(end, len(h.logprobs))):
        sampled = entry(h.output_ids[i], h.logprobs[i])
        rows = h.top_logprobs[i] if call.logprobs and i < len(h.top_logprobs) else []
        tops = [entry(t, lp) for lp, t in rows]
        content.append(
            TokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes, top_logprobs=tops)
        )
    return ChatLogprobs(content=content, refusal=None)


def _completion_logprobs_of(
    worker: ModelWorker, call: Call, choice: Choice, start: int, end: int
) -> CompletionLogprobs | None:
    return None if call.logprobs is None else _completion_logprobs(worker, call, choice, start, end)


def _chat_logprobs_of(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> ChatLogprobs | None:
    return None if call.logprobs is None else _chat_logprobs(worker, call, choice, start, end)


# -- whole answers --------------------------------------------------------------------------------


def _completion_choice(call: Call, worker: ModelWorker, choice: Choice) -> CompletionChoice:
    h = choice.running
    text = visible_text(worker, choice)
    reason, stop = finish(choice)
    echo = call.echo_texts[choice.prompt_index] if call.echo_texts is not None else ""
    item = CompletionChoice(
        index=choice.index,
        text=echo + text,
        logprobs=_completion_logprobs_of(worker, call, choice, 0, len(h.output_ids)),
        finish_reason=reason,
        stop_reason=stop,
    )
    if call.return_token_ids:
        item.token_ids = list(h.output_ids)
        item.prompt_token_ids = call.prompts[choice.prompt_index]
    item.weight_versions = spans(worker, choice)
    item.first_token_weight_version = h.first_token_weight_version
    return item


def _chat_choice(call: Call, worker: ModelWorker, choice: Choice) -> ChatChoice:
    h = choice.running
    text = visible_text(worker, choice)
    reason, stop = finish(choice)
    item = ChatChoice(
        index=choice.index,
        message=ChatResponseMessage(role="assistant", content=text),
        logprobs=_chat_logprobs_of(worker, call, choice, 0, len(h.output_ids)),
        finish_reason=reason,
        stop_reason=stop,
    )
    if call.return_token_ids:
        item.token_ids = list(h.output_ids)
    item.weight_versions = spans(worker, choice)
    item.first_token_weight_version = h.first_token_weight_version
    return item


def response_body(call: Call, worker: ModelWorker) -> Answer:
    if call.kind == "tokens":
        return tokens_answers.response_body(call, worker)
    version = weight_version(call, worker)
    metadata = ResponseMetadata(weight_version=version)
    if call.adapter is not None:
        metadata.lora_name, metadata.lora_version = call.adapter.name, str(call.adapter.version)
    if call.kind == "completion":
        return CompletionResponse(
            id=call.id,
            object="text_completion",
            created=call.created,
            model=call.model,
            weight_version=version,
            metadata=metadata,
            choices=[_completion_choice(call, worker, c) for c in call.choices],
            usage=usage(call),
        )
    answer = ChatCompletionResponse(
        id=call.id,
        object="chat.completion",
        created=call.created,
        model=call.model,
        weight_version=version,
        metadata=metadata,
        choices=[_chat_choice(call, worker, c) for c in call.choices],
        usage=usage(call),
    )
    if call.return_token_ids:
        answer.prompt_token_ids = call.prompts[0]
    return answer


# -- streamed chunks ------------------------------------------------------------------------------


def _chunk_fields(call: Call, worker: ModelWorker) -> dict[str, Any]:
    """What every streamed chunk of ``call`` carries besides its ``object`` and ``choices``."""
    version = weight_version(call, worker)
    fields: dict[str, Any] = {
        "id": call.id,
        "created": call.created,
        "model": call.model,
        "weight_version": version,
        "metadata": ResponseMetadata(weight_version=version),
    }
    if call.include_usage:
        fields["usage"] = None  # sent as null on every chunk, counted on the last (OpenAI's include_usage)
    return fields


def _completion_chunk(call: Call, worker: ModelWorker, choices: list[CompletionChoice]) -> CompletionResponse:
    return CompletionResponse(object="text_completion", choices=choices, **_chunk_fields(call, worker))


def _chat_chunk(call: Call, worker: ModelWorker, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
    return ChatCompletionChunk(object="chat.completion.chunk", choices=choices, **_chunk_fields(call, worker))


def opening(call: Call, worker: ModelWorker, choice: Choice) -> Chunk | None:
    """A choice's first chunk: the assistant role (chat), the echoed prompt (completions with echo)."""
    if call.kind == "chat":
        start = ChatChunkChoice(
            index=choice.index, delta=ChatDelta(role="assistant", content=""), logprobs=None, finish_reason=None
        )
        return _chat_chunk(call, worker, [start])
    if call.kind != "completion" or call.echo_texts is None:
        return None
    echo = CompletionChoice(
        index=choice.index, text=call.echo_texts[choice.prompt_index], logprobs=None, finish_reason=None
    )
    if call.return_token_ids:
        echo.prompt_token_ids = call.prompts[choice.prompt_index]
    return _completion_chunk(call, worker, [echo])


def _close(
    call: Call,
    worker: ModelWorker,
    choice: Choice,
    item: CompletionChoice | ChatChunkChoice,
    reason: FinishReasonName | None,
    stop: int | str | None,
    start: int,
    end: int,
) -> None:
    """The fields a chunk's choice carries after its text and logprobs: ``stop_reason`` on its last
    chunk, its new ``token_ids`` when asked, its weight versions so far."""
    h = choice.running
    if reason is not None:
        item.stop_reason = stop
        choice.closed = True
    if call.return_token_ids:
        item.token_ids = h.output_ids[start:end]
    item.weight_versions = spans(worker, choice)
    item.first_token_weight_version = h.first_token_weight_version


def delta(call: Call, worker: ModelWorker, choice: Choice) -> Chunk | None:
    """The chunk for what ``choice`` produced since its last one, or None when nothing shows yet."""
    if call.kind == "tokens":
        return tokens_answers.delta(call, worker, choice)
    h = choice.running
    text = visible_text(worker, choice)
    new = text[len(choice.sent_text) :] if len(text) > len(choice.sent_text) else ""
    start, end = choice.sent_tokens, len(h.output_ids)
    reason, stop = finish(choice)
    wants_tokens = call.logprobs is not None or call.return_token_ids
    if not new and reason is None and not (wants_tokens and end > start):
        return None
    if new:
        choice.sent_text = text
    choice.sent_tokens = end
    if call.kind == "completion":
        piece = CompletionChoice(
            index=choice.index,
            text=new,
            logprobs=_completion_logprobs_of(worker, call, choice, start, end),
            finish_reason=reason,
        )
        _close(call, worker, choice, piece, reason, stop, start, end)
        return _completion_chunk(call, worker, [piece])
    chat = ChatChunkChoice(
        index=choice.index,
        delta=ChatDelta(content=new) if new else ChatDelta(),
        logprobs=_chat_logprobs_of(worker, call, choice, start, end),
        finish_reason=reason,
    )
    _close(call, worker, choice, chat, reason, stop, start, end)
    return _chat_chunk(call, worker, [chat])


def usage_chunk(call: Call, worker: ModelWorker) -> Chunk:
    """The last chunk with ``include_usage``: no choices, the call's token counts."""
    if call.kind == "tokens":
        return tokens_answers.usage_chunk(call, worker)
    last: CompletionResponse | ChatCompletionChunk = (
        _completion_chunk(call, worker, []) if call.kind == "completion" else _chat_chunk(call, worker, [])
    )
    last.usage = usage(call)
    return last
