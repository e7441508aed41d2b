"""The event-loop side of one generation: accumulate its output, build its response.

The scheduler thread owns the :class:`~worker.engine.request.Request`; the
HTTP handler owns a :class:`GenerationHandle`, which only ever reads the events
the scheduler posts, so no state is shared between the two threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from worker.engine.request import FinishReason, OutputChannel, Request, RequestEvent
from worker.engine.sampling import trim_stop_string


class GenerationHandle:
    """Output received so far for one request, and whether it has finished."""

    def __init__(self, request: Request, channel: OutputChannel, *, return_text_in_logprobs: bool = False):
        self.rid = request.rid
        self.prompt_tokens = len(request.prompt_ids)
        self.params = request.params
        self.channel = channel
        self.return_text_in_logprobs = return_text_in_logprobs
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.finish_reason: FinishReason | None = None
        self.retractions = 0
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
        self.output_ids.extend(event.new_ids)
        self.logprobs.extend(event.new_logprobs)
        self.top_logprobs.extend(event.new_top_logprobs)
        self.retractions = event.retractions
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.finished_at = time.monotonic()

    def build(
        self, decode: Callable[[list[int]], str], weight_version: str, index: int | None = None
    ) -> dict[str, Any]:
        """The SGLang-shaped ``{"text", "output_ids", "meta_info"}`` for what was received so far.

        ``weight_version`` is read when the response is built (SGLang v0.5.9
        semantics): one string, not a per-token history. Input-token logprobs
        are not computed (the engine only keeps last-position logits), so
        ``input_token_logprobs`` is an empty list, the shape SGLang returns for
        ``logprob_start_len=-1``.
        """
        text = trim_stop_string(decode(self.output_ids), self.finish_reason, self.params.no_stop_trim)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_wire() if self.finish_reason is not None else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "total_retractions": self.retractions,
            "e2e_latency": (self.finished_at or time.monotonic()) - self.created,
        }
        if self.params.return_logprob:

            def entry(lp: float, tok: int) -> list[Any]:
                return [lp, tok, decode([tok]) if self.return_text_in_logprobs else None]

            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                entry(lp, tok) for lp, tok in zip(self.logprobs, self.output_ids, strict=False)
            ]
            if self.params.top_logprobs_num:
                meta["output_top_logprobs"] = [[entry(lp, tok) for lp, tok in row] for row in self.top_logprobs]
        out: dict[str, Any] = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out
