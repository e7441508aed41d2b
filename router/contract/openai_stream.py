"""Streamed ``/v1/chat/completions`` answers: OpenAI's ``chat.completion.chunk`` objects.

Each ``data:`` event is one :class:`ChatCompletionChunk`, then ``data: [DONE]``. A choice's first
chunk carries ``delta: {"role": "assistant", "content": ""}``; later ones its new content (``{}``
when a chunk brings only token ids or the finish), its weight versions so far, and on its last the
``finish_reason`` and vLLM's ``stop_reason``. With ``stream_options.include_usage`` every chunk
has ``usage: null`` and a last chunk without choices carries the counts. A completion streams
:class:`~router.contract.openai.CompletionResponse` objects (OpenAI's ``Completion`` shape).

As for every answer of :mod:`router.contract.openai`, a field the worker leaves out is absent,
not null. Nothing here imports torch.
"""

from __future__ import annotations

from router.contract.base import WireResponse
from router.contract.openai import ChoiceTail, ResponseMetadata, Usage


class ChatDelta(WireResponse):
    """What a chunk adds to its choice's message."""

    role: str | None = None
    content: str | None = None


class _ChatChunkChoiceHead(WireResponse):
    index: int
    delta: ChatDelta


# Fields: ``index``, ``delta``, then ChoiceTail's (see there for the order).
class ChatChunkChoice(ChoiceTail, _ChatChunkChoiceHead):
    """One choice of a chunk; ``stop_reason`` only on its last, ``token_ids`` only with ``return_token_ids``."""


class ChatCompletionChunk(WireResponse):
    """One event of a streamed ``/v1/chat/completions`` answer (``object`` ``chat.completion.chunk``)."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    weight_version: str
    metadata: ResponseMetadata | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
