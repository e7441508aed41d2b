"""The JSON edge of the generation answers: a contract model, sent with the keys the worker set.

The answers of ``/generate``, the OpenAI routes and vLLM's token route are built as the models of
:mod:`router.contract` (the ones their ``GET /openapi.json`` describes) and turned into JSON only
here. A field is sent when the builder set it, to a value or to ``None``, and is absent otherwise
(``exclude_unset``): the answers these servers copy leave some keys out rather than send ``null``
(vLLM's ``token_ids`` without ``return_token_ids``, SGLang's logprob lists without
``return_logprob``), and their clients tell the two apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from aiohttp import web
from pydantic import BaseModel


def dump(answer: BaseModel) -> object:
    """The answer as JSON values: the fields its builder set, in the model's order."""
    return answer.model_dump(mode="json", exclude_unset=True)


def json_answer(answer: BaseModel | Sequence[BaseModel]) -> web.Response:
    """A 200 holding the answer, or a list of them (a batch)."""
    return web.json_response(dump(answer) if isinstance(answer, BaseModel) else [dump(a) for a in answer])


def sse_event(answer: BaseModel | Mapping[str, object]) -> bytes:
    """One server-sent event holding the answer (or a body built elsewhere: the error shape)."""
    body = dump(answer) if isinstance(answer, BaseModel) else answer
    return b"data: " + json.dumps(body).encode() + b"\n\n"
