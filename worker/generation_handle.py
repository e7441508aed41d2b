"""The event-loop side of one generation: accumulate its output, build its response.

The scheduler thread owns the :class:`~worker.engine.request.Request`; the
HTTP handler owns a :class:`GenerationHandle`, which only ever reads the events
the scheduler posts, so no state is shared between the two threads.

Weight-version spans (SGLang v0.5.23's ``meta_info.weight_versions``): each
event names, per token, the version of the weights that sampled it; the handle
folds them into ordered spans ``{version, start, end}`` over output indices,
``end`` exclusive, adjacent, covering ``[0, len(output_ids))`` exactly, a new
span wherever the version changes. An empty output has one span
``{current, 0, 0}``. ``weight_version`` is the last span's version.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.contract.generate import GenerateMetaInfo, GenerateResponse, LogprobEntry, WeightVersionSpan
from worker.engine.request import FinishReason, OutputChannel, Request, RequestEvent
from worker.engine.sampling import trim_stop_string

#: Orders output arrivals across handles (event-loop side only), so an answer over several requests
#: can name the version that produced its newest token.
_ARRIVALS = itertools.count(1)


@dataclass(slots=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of one request, all sampled by weights of ``version``."""

    version: str
    start: int
    end: int

    def to_wire(self) -> WeightVersionSpan:
        return WeightVersionSpan(version=self.version, start=self.start, end=self.end)


class GenerationHandle:
    """Output received so far for one request, and whether it has finished."""

    def __init__(self, request: Request, channel: OutputChannel, *, return_text_in_logprobs: bool = False):
        self.rid = request.rid
        self.adapter = request.adapter
        self.prompt_tokens = len(request.prompt_ids)
        self.params = request.params
        self.channel = channel
        self.return_text_in_logprobs = return_text_in_logprobs
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.finish_reason: FinishReason | None = None
        self.retractions = 0
        self.version_spans: list[VersionSpan] = []
        self.last_arrival = 0
        """When this request last received tokens, on :data:`_ARRIVALS`' scale (0: none yet)."""
        self.created = time.monotonic()
        self.finished_at: float | None = None
        # Set once the HTTP handler has produced this request's final response.
        self.returned = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def next_event(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the next event; True if one arrived."""
        try:
            async with asyncio.timeout(wait_s):
                event = await self.channel.queue.get()
        except TimeoutError:
            return False
        self._apply(event)
        return True

    def drain(self) -> bool:
        """Apply every event already delivered, without waiting; True if there was any."""
        got = False
        while True:
            try:
                event = self.channel.queue.get_nowait()
            except asyncio.QueueEmpty:
                return got
            self._apply(event)
            got = True

    def _apply(self, event: RequestEvent) -> None:
        spans, index = self.version_spans, len(self.output_ids)
        for version in event.new_weight_versions:
            if spans and spans[-1].version == version:
                spans[-1].end = index + 1
            else:
                spans.append(VersionSpan(version, index, index + 1))
            index += 1
        if event.new_ids:
            self.last_arrival = next(_ARRIVALS)
        self.output_ids.extend(event.new_ids)
        self.logprobs.extend(event.new_logprobs)
        self.top_logprobs.extend(event.new_top_logprobs)
        self.retractions = event.retractions
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.finished_at = time.monotonic()

    def weight_versions(self, current: str) -> list[WeightVersionSpan]:
        """The spans of the output so far; ``current`` (the served version) names the one empty span of an
        empty output."""
        if not self.version_spans:
            return [VersionSpan(current, 0, 0).to_wire()]
        return [span.to_wire() for span in self.version_spans]

    def weight_version(self, current: str) -> str:
        """The version that sampled the last token (SGLang's ``weight_version``); ``current`` when none was."""
        return self.version_spans[-1].version if self.version_spans else current

    @property
    def first_token_weight_version(self) -> str | None:
        """The version that sampled the first token, None before there is one. Not the version at admission:
        a request that waits in the queue can see a whole update before its first token."""
        return self.version_spans[0].version if self.version_spans else None

    def build(
        self, decode: Callable[[list[int]], str], weight_version: str, index: int | None = None
    ) -> GenerateResponse:
        """SGLang's ``{"text", "output_ids", "meta_info"}`` for what was received so far (``index``: its
        place in a streamed batch).

        ``weight_version`` is the served version now; the answer reports the versions that sampled its
        tokens (see the module docstring) and falls back to it only for an empty output. Input-token
        logprobs are not computed (the engine only keeps last-position logits), so
        ``input_token_logprobs`` is an empty list, the shape SGLang returns for ``logprob_start_len=-1``.
        """
        text = trim_stop_string(decode(self.output_ids), self.finish_reason, self.params.no_stop_trim)
        meta = GenerateMetaInfo(
            id=self.rid,
            finish_reason=self.finish_reason.to_wire() if self.finish_reason is not None else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=0,
            weight_version=self.weight_version(weight_version),
            weight_versions=self.weight_versions(weight_version),
            first_token_weight_version=self.first_token_weight_version,
            total_retractions=self.retractions,
            e2e_latency=(self.finished_at or time.monotonic()) - self.created,
        )
        if self.adapter is not None:  # set only then: a base model's answer keeps SGLang's shape
            meta.lora_name, meta.lora_version = self.adapter.name, self.adapter.version
        if self.params.return_logprob:

            def entry(lp: float, tok: int) -> LogprobEntry:
                return (lp, tok, decode([tok]) if self.return_text_in_logprobs else None)

            meta.input_token_logprobs = []
            meta.output_token_logprobs = [
                entry(lp, tok) for lp, tok in zip(self.logprobs, self.output_ids, strict=False)
            ]
            if self.params.top_logprobs_num:
                meta.output_top_logprobs = [[entry(lp, tok) for lp, tok in row] for row in self.top_logprobs]
        out = GenerateResponse(text=text, output_ids=list(self.output_ids), meta_info=meta)
        if index is not None:
            out.index = index
        return out
