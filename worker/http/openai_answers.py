"""The bodies of OpenAI-compatible answers: whole responses, streamed chunks, logprobs and usage.

Built from a :class:`Call` (the prompts and choices of one ``/v1/completions``,
``/v1/chat/completions`` or vLLM ``/inference/v1/generate`` call, each choice one engine request)
as its requests progress; the routes in :mod:`worker.http.openai_routes` and
:mod:`worker.http.tokens_routes` submit the requests and send what is built here. A ``tokens``
call answers vLLM's ``GenerateResponse`` (``request_id``, ``choices[].token_ids``, logprobs as
``token_id:<id>`` entries) and streams its ``GenerateStreamResponse`` chunks.

Weight versions: each choice carries its own ``weight_versions`` spans and
``first_token_weight_version`` (a choice is one engine request, see
:mod:`worker.generation`); the answer's ``weight_version`` (top level and
``metadata``, a flat string map as OpenAI's schema wants) is the version that
sampled the call's newest token, or the served one before any token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from router.contract.openai import LOGPROB_FLOOR, FinishReasonName
from worker.engine.model_worker import ModelWorker
from worker.engine.request import FinishKind, GenerationParams
from worker.engine.sampling import trim_stop_string
from worker.generation import GenerationHandle

Kind = Literal["completion", "chat", "tokens"]


@dataclass(eq=False)
class Choice:
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
class Call:
    """One OpenAI call: its prompts, its choices and what the answer must hold."""

    kind: Kind
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    choices: list[Choice]
    echo_texts: list[str] | None
    logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool
    include_usage: bool
    continuous_usage: bool = False
    """``tokens``: every streamed chunk carries its choice's usage so far (``continuous_usage_stats``)."""
    prompt_ids_sent: bool = False
    """``tokens`` with ``return_token_ids``: the first streamed chunk carried ``prompt_token_ids``."""
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, worker: ModelWorker, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = f"token_id:{token}" if self.tokens_as_ids else worker.decode([token])
            self._token_text[token] = text
        return text


# -- answers --------------------------------------------------------------------------------------


def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _finish(choice: Choice) -> tuple[FinishReasonName | None, int | str | None]:
    """OpenAI's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or stop token; None for EOS)."""
    h = choice.handle
    assert h is not None
    reason = h.finish_reason
    if reason is None:
        return None, None
    if reason.kind is FinishKind.STOP:
        matched = reason.matched
        if isinstance(matched, int) and matched not in choice.params.stop_token_ids:
            matched = None  # EOS: vLLM reports no stop_reason
        return "stop", matched
    if reason.kind is FinishKind.LENGTH:
        return "length", None
    return "abort", None


def _visible_text(worker: ModelWorker, choice: Choice) -> str:
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


def _completion_logprobs(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> dict[str, Any]:
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


def _chat_logprobs(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> dict[str, Any]:
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


def _tokens_logprobs(call: Call, choice: Choice, start: int, end: int) -> dict[str, Any]:
    """vLLM's token-answer logprobs: each token as ``token_id:<id>``, and ``max(k, 1)`` top entries with
    the sampled token first (vLLM's per-position dict holds the sampled token, then the top k)."""
    h = choice.handle
    assert h is not None
    keep = max(call.logprobs or 0, 1)

    def entry(token: int, value: float) -> dict[str, Any]:
        return {"token": f"token_id:{token}", "logprob": _logprob(value), "bytes": None}

    content = []
    for i in range(start, min(end, len(h.logprobs))):
        token, value = h.output_ids[i], h.logprobs[i]
        rows = h.top_logprobs[i] if i < len(h.top_logprobs) else []
        tops = [entry(token, value), *(entry(t, lp) for lp, t in rows if t != token)]
        content.append({**entry(token, value), "top_logprobs": tops[:keep]})
    return {"content": content}


def _logprobs_of(worker: ModelWorker, call: Call, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
    if call.logprobs is None:
        return None
    if call.kind == "completion":
        return _completion_logprobs(worker, call, choice, start, end)
    if call.kind == "tokens":
        return _tokens_logprobs(call, choice, start, end)
    return _chat_logprobs(worker, call, choice, start, end)


def usage(call: Call) -> dict[str, int]:
    prompt = sum(len(p) for p in call.prompts)
    completion = sum(len(c.handle.output_ids) for c in call.choices if c.handle is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _weight_version(call: Call, worker: ModelWorker) -> str:
    """The version that sampled the call's newest token; the served version before the first."""
    handles = [c.handle for c in call.choices if c.handle is not None and c.handle.last_arrival]
    if not handles:
        return worker.weight_version
    return max(handles, key=lambda h: h.last_arrival).weight_version(worker.weight_version)


def _choice_versions(worker: ModelWorker, choice: Choice) -> dict[str, Any]:
    """A choice's ``weight_versions`` spans (so far) and ``first_token_weight_version``."""
    h = choice.handle
    assert h is not None
    return {
        "weight_versions": h.weight_versions(worker.weight_version),
        "first_token_weight_version": h.first_token_weight_version,
    }


def envelope(call: Call, worker: ModelWorker, chunk: bool) -> dict[str, Any]:
    if call.kind == "tokens":
        head: dict[str, Any] = {"request_id": call.id}
        if not chunk:
            head.update(model=call.model, created=call.created)
        head["weight_version"] = _weight_version(call, worker)
        return head
    objects = {
        "completion": ("text_completion", "text_completion"),
        "chat": ("chat.completion", "chat.completion.chunk"),
    }
    obj = objects[call.kind][chunk]
    version = _weight_version(call, worker)
    return {
        "id": call.id,
        "object": obj,
        "created": call.created,
        "model": call.model,
        "weight_version": version,
        "metadata": {"weight_version": version},
    }


def _tokens_body(call: Call, worker: ModelWorker) -> dict[str, Any]:
    """vLLM's ``GenerateResponse`` (its ``model_dump``: absent parts as ``null``)."""
    choices = []
    for choice in call.choices:
        h = choice.handle
        assert h is not None
        finish, _ = _finish(choice)
        choices.append(
            {
                "index": choice.index,
                "logprobs": _logprobs_of(worker, call, choice, 0, len(h.output_ids)),
                "finish_reason": finish or "stop",
                "token_ids": list(h.output_ids),
                "routed_experts": None,
                "sampling_mask": None,
                **_choice_versions(worker, choice),
            }
        )
    out = envelope(call, worker, chunk=False)
    out.update(
        choices=choices,
        usage={**usage(call), "prompt_tokens_details": None},
        prompt_logprobs=None,
        prompt_token_id_logprobs=None,
        prompt_token_ids=call.prompts[0] if call.return_token_ids else None,
        mm_placeholders=None,
        metrics=None,
        kv_transfer_params=None,
        ec_transfer_params=None,
    )
    return out


def response_body(call: Call, worker: ModelWorker) -> dict[str, Any]:
    if call.kind == "tokens":
        return _tokens_body(call, worker)
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
        item.update(_choice_versions(worker, choice))
        choices.append(item)
    out = envelope(call, worker, chunk=False)
    out["choices"] = choices
    out["usage"] = usage(call)
    if call.return_token_ids and call.kind == "chat":
        out["prompt_token_ids"] = call.prompts[0]
    return out


def chunk(call: Call, worker: ModelWorker, choices: list[dict[str, Any]]) -> dict[str, Any]:
    out = envelope(call, worker, chunk=True)
    out["choices"] = choices
    if call.kind == "tokens":
        # vLLM's GenerateStreamResponse: ``usage`` always (null unless continuous), the prompt's ids once.
        out["usage"] = None
        if call.continuous_usage and choices:
            h = call.choices[choices[0]["index"]].handle
            prompt, done = len(call.prompts[0]), len(h.output_ids) if h is not None else 0
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if call.return_token_ids and not call.prompt_ids_sent:
            out["prompt_token_ids"] = call.prompts[0]
            call.prompt_ids_sent = True
    elif call.include_usage:
        out["usage"] = None
    return out


def delta(call: Call, worker: ModelWorker, choice: Choice) -> dict[str, Any] | None:
    """The chunk entry for what ``choice`` produced since the last one, or None when nothing shows yet."""
    h = choice.handle
    assert h is not None
    if call.kind == "tokens":
        return _tokens_delta(call, worker, choice)
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
    item.update(_choice_versions(worker, choice))
    return item


def _tokens_delta(call: Call, worker: ModelWorker, choice: Choice) -> dict[str, Any] | None:
    """A ``tokens`` chunk's choice: the new ``token_ids`` (and their logprobs), the finish on the last."""
    h = choice.handle
    assert h is not None
    start, end = choice.sent_tokens, len(h.output_ids)
    finish, _ = _finish(choice)
    if end == start and finish is None:
        return None
    choice.sent_tokens = end
    choice.closed = finish is not None
    return {
        "index": choice.index,
        "logprobs": _logprobs_of(worker, call, choice, start, end),
        "finish_reason": finish,
        "token_ids": h.output_ids[start:end],
        "routed_experts": None,
        "sampling_mask": None,
        **_choice_versions(worker, choice),
    }


def opening(call: Call, choice: Choice) -> dict[str, Any] | None:
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
