"""Per-request state, and the channel that carries its output to the event loop.

A :class:`Request` is owned by the scheduler thread from submission to finish.
The HTTP side only sees :class:`RequestEvent` objects arriving on the request's
:class:`OutputChannel`: token deltas while streaming, then one final event.
Every token travels with the ``weight_version`` of the step that sampled it,
recorded on the scheduler thread, which alone changes the weights (between steps).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import torch

from router.contract import generate as wire
from worker.model import KVCache
from worker.model.lora import LoadedLora


class ReqState(enum.Enum):
    """Where a request is in the scheduler; only RUNNING requests hold KV."""

    WAITING = "waiting"  # no KV: not admitted yet, or retracted
    RUNNING = "running"  # holds KV computed with the current weights
    FINISHED = "finished"


class FinishKind(enum.Enum):
    """Why a request ended: SGLang's ``finish_reason.type``, and OpenAI's ``finish_reason``."""

    STOP = "stop"  # a stop token, EOS or a stop string
    LENGTH = "length"  # max_new_tokens, or the context length
    ABORT = "abort"  # an abort, a pause in abort mode, an error, shutdown


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended; built with :meth:`stopped`, :meth:`at_length` or :meth:`aborted`, so exactly the
    field of its kind is set (``matched``, ``length`` or ``message``)."""

    kind: FinishKind
    matched: int | str | None = None
    """``stop``: the stop token (or EOS) id, or the stop string."""
    length: int | None = None
    """``length``: the token count it ended at."""
    message: str | None = None
    """``abort``: why."""

    @classmethod
    def stopped(cls, matched: int | str) -> FinishReason:
        return cls(FinishKind.STOP, matched=matched)

    @classmethod
    def at_length(cls, length: int) -> FinishReason:
        return cls(FinishKind.LENGTH, length=length)

    @classmethod
    def aborted(cls, message: str = "Aborted") -> FinishReason:
        return cls(FinishKind.ABORT, message=message)

    @property
    def stop_string(self) -> str | None:
        """The stop string it matched, if it stopped on one (the text is cut before it)."""
        return self.matched if self.kind is FinishKind.STOP and isinstance(self.matched, str) else None

    def to_wire(self) -> wire.FinishReason:
        """SGLang's ``{"type": "stop", "matched": ...}`` | ``{"type": "length", "length": N}``
        | ``{"type": "abort", "message": ...}``: only its kind's field is set, so only it is sent."""
        if self.kind is FinishKind.STOP:
            return wire.FinishReason(type="stop", matched=self.matched)
        if self.kind is FinishKind.LENGTH:
            return wire.FinishReason(type="length", length=self.length)
        return wire.FinishReason(type="abort", message=self.message)


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping parameters of one request, resolved and validated."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class RequestEvent:
    """Output delivered to the event loop: new tokens since the last event, and
    ``finish_reason`` on the final event."""

    new_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[float, int]]]
    finish_reason: FinishReason | None
    retractions: int
    new_weight_versions: list[str]
    """The ``weight_version`` of the weights that sampled each of ``new_ids`` (one per token)."""


class OutputChannel:
    """Thread-safe hand-off of :class:`RequestEvent` objects to one asyncio queue.

    ``wakeup`` (optional, shared by the prompts of one HTTP call) is set on
    every delivery so one waiter can follow many requests.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, wakeup: asyncio.Event | None = None):
        self._loop = loop
        self.queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.wakeup = wakeup

    def post(self, event: RequestEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:
            # The event loop is closed (shutdown): nobody is waiting any more.
            pass

    def _deliver(self, event: RequestEvent) -> None:
        self.queue.put_nowait(event)
        if self.wakeup is not None:
            self.wakeup.set()


@dataclass(eq=False)
class Request:
    """One prompt's generation, as the scheduler sees it."""

    rid: str
    prompt_ids: list[int]
    params: GenerationParams
    channel: OutputChannel | None = None
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_weight_versions: list[str] = field(default_factory=list)
    """Per output token, the ``weight_version`` of the forward step that sampled it. A token keeps it
    through later updates, also when a retraction recomputes its KV with newer weights."""
    state: ReqState = ReqState.WAITING
    kv: KVCache | None = None
    finish_reason: FinishReason | None = None
    retractions: int = 0
    generator: torch.Generator | None = None
    adapter: LoadedLora | None = None
    """The LoRA adapter every forward step of this request uses, retractions included (None: the base)."""
    _sent: int = 0  # output tokens already delivered to the channel

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def pending_tokens(self) -> list[int]:
        """Tokens not yet in the KV cache: the whole prompt on prefill, the
        last sampled token on decode, prompt + output after a retraction."""
        done = self.kv.length if self.kv is not None else 0
        prompt_len = len(self.prompt_ids)
        if done < prompt_len:
            return self.prompt_ids[done:] + self.output_ids
        return self.output_ids[done - prompt_len :]

    def drop_kv(self) -> None:
        self.kv = None

    def append(
        self, token: int, logprob: float | None, top: list[tuple[float, int]] | None, weight_version: str
    ) -> None:
        """Record a sampled token and the version of the weights whose forward step sampled it."""
        self.output_ids.append(token)
        self.output_weight_versions.append(weight_version)
        if self.params.return_logprob:
            self.output_logprobs.append(float(logprob) if logprob is not None else 0.0)
            if self.params.top_logprobs_num:
                self.output_top_logprobs.append(top or [])

    def emit(self, final: bool) -> None:
        """Send what the caller has not seen yet (streaming: every step; otherwise only at the end)."""
        if self.channel is None or (not final and not self.stream):
            return
        start = self._sent
        if not final and start == len(self.output_ids):
            return
        self._sent = len(self.output_ids)
        self.channel.post(
            RequestEvent(
                new_ids=self.output_ids[start:],
                new_logprobs=self.output_logprobs[start:] if self.params.return_logprob else [],
                new_top_logprobs=self.output_top_logprobs[start:] if self.params.top_logprobs_num else [],
                finish_reason=self.finish_reason if final else None,
                retractions=self.retractions,
                new_weight_versions=self.output_weight_versions[start:],
            )
        )
