"""Turn a request body into a wire model, or a clear 400.

JSON is decoded with two limits Python's decoder does not have: the literals
``NaN``, ``Infinity`` and ``-Infinity`` are refused (they are not JSON, and a
non-finite number has no meaning in any field), and nesting deeper than
:data:`~router.contract.base.MAX_JSON_DEPTH` is refused, before the decoder
could run out of stack on it.
"""

from __future__ import annotations

import json
import re
import types
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from aiohttp import web
from pydantic import BaseModel, ValidationError

from router.contract.base import MAX_JSON_DEPTH
from router.contract.errors import ApiError

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 64 * 1024 * 1024


async def read_json(request: web.Request, *, allow_empty: bool = True) -> dict[str, Any]:
    """Read the body as a JSON object; an empty body (or GET) is ``{}`` when allowed."""
    raw = await request.read() if request.can_read_body else b""
    if raw == b"{}":  # most admin calls: nothing to scan or decode
        return {}
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "request body is required")
    data = decode_json(raw)
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def decode_json(raw: bytes) -> Any:
    """Decode a request body, or raise a 400 saying why it is not acceptable JSON."""
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} levels are accepted")
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


#: A JSON string, written as runs between escapes: one step per run, not one alternation per byte (a
#: 64 MiB string field scans in a fraction of a second instead of seconds).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(raw: bytes) -> int:
    """How deeply ``raw`` nests arrays and objects (brackets inside strings ignored), counted up to
    one past :data:`~router.contract.base.MAX_JSON_DEPTH`.

    Strings are cut out and every byte but brackets dropped, then each pass removes the innermost
    ``[]`` and ``{}`` pairs: all in C, so a long body costs a few scans, not a Python loop per byte."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= MAX_JSON_DEPTH:
        inner = _INNERMOST.sub(b"", brackets)
        if inner == brackets:  # unbalanced: the decoder reports it
            break
        brackets = inner
        depth += 1
    return depth


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this API accepts (non-finite values are refused)")


#: ``json.loads(raw, parse_constant=...)`` builds a decoder per call; one serves every body.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def parse_model(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, validation_message(exc)) from None
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"invalid request: {exc}") from None


def _is_list(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin is list:
        return True
    if origin is Annotated:
        return _is_list(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(_is_list(arg) for arg in get_args(annotation))
    return False


def query_fields(request: web.Request, model: type[BaseModel]) -> dict[str, Any]:
    """The query parameters as ``model``'s input, as vLLM's dev routes read them: a field typed as a
    list takes every value of its repeated name (``?tags=weights&tags=kv_cache``), others the last one."""
    query = request.query
    return {
        key: query.getall(key)
        if key in model.model_fields and _is_list(model.model_fields[key].annotation)
        else query.getall(key)[-1]
        for key in query
    }


async def parse_query_first(request: web.Request, model: type[M]) -> M:
    """A body whose fields the query parameters override (:func:`query_fields`): vLLM's dev routes."""
    data = await read_json(request, allow_empty=True)
    return parse_model(model, {**data, **query_fields(request, model)})


async def parse_body(request: web.Request, model: type[M], *, allow_empty: bool = True) -> M:
    """Parse and validate a JSON body (query parameters fill in missing fields)."""
    data = await read_json(request, allow_empty=allow_empty)
    for key, value in request.query.items():
        data.setdefault(key, value)
    return parse_model(model, data)
