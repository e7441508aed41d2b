"""One OpenAI-shaped call, and what every kind of its answers reads from it.

A :class:`Call` holds the prompts and choices of one ``/v1/completions``, ``/v1/chat/completions``
or vLLM ``/inference/v1/generate`` call, each choice one engine request, and what each choice has
sent so far when it streams. The answers are built from it in :mod:`worker.http.openai_answers`
(OpenAI's shapes) and :mod:`worker.http.tokens_answers` (vLLM's token shapes).

Weight versions: each choice carries its own ``weight_versions`` spans and
``first_token_weight_version`` (a choice is one engine request, see
:mod:`worker.generation_handle`); the answer's ``weight_version`` is the version that sampled the call's
newest token, or the served one before any token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from router.contract.generate import WeightVersionSpan
from router.contract.openai import LOGPROB_FLOOR, FinishReasonName, Usage
from worker.engine.model_worker import ModelWorker
from worker.engine.request import FinishKind, GenerationParams
from worker.engine.sampling import trim_stop_string
from worker.generation_handle import GenerationHandle
from worker.model.lora import LoadedLora

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

    @property
    def running(self) -> GenerationHandle:
        """The choice's request (submitted before any answer is built)."""
        assert self.handle is not None
        return self.handle


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
    adapter: LoadedLora | None = None
    """The LoRA adapter every choice is generated with (None: the base model)."""
    prompt_ids_sent: bool = False
    """``tokens`` with ``return_token_ids``: the first streamed chunk carried ``prompt_token_ids``."""
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, worker: ModelWorker, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = f"token_id:{token}" if self.tokens_as_ids else worker.decode([token])
            self._token_text[token] = text
        return text


def logprob(value: float) -> float:
    """A log-probability as JSON can carry it: clamped to vLLM's floor (JSON has no ``-Infinity``)."""
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def finish(choice: Choice) -> tuple[FinishReasonName | None, int | str | None]:
    """OpenAI's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or stop token; None for EOS)."""
    h = choice.running
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


def visible_text(worker: ModelWorker, choice: Choice) -> str:
    """The choice's text so far, without what might still change: the start of a stop string or a
    character whose bytes have not all arrived (both only while the choice runs)."""
    h = choice.running
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


def usage(call: Call) -> Usage:
    """Token counts: every prompt once, every choice's output."""
    prompt = sum(len(p) for p in call.prompts)
    completion = sum(len(c.handle.output_ids) for c in call.choices if c.handle is not None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def weight_version(call: Call, worker: ModelWorker) -> str:
    """The version that sampled the call's newest token; the served version before the first."""
    handles = [c.handle for c in call.choices if c.handle is not None and c.handle.last_arrival]
    if not handles:
        return worker.weight_version
    return max(handles, key=lambda h: h.last_arrival).weight_version(worker.weight_version)


def spans(worker: ModelWorker, choice: Choice) -> list[WeightVersionSpan]:
    """A choice's ``weight_versions`` so far (its ``first_token_weight_version`` is its handle's)."""
    return choice.running.weight_versions(worker.weight_version)
