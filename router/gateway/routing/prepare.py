"""How a generation request's body is made ready to forward, and how it is aborted.

Each proxied route has one :data:`Prepare` function: it returns the body to send, the
:class:`AbortCall` that stops the request on its worker if the caller goes away (a ``rid`` or
vLLM ``request_id`` is assigned when the caller gave none, so there is always something to
abort by), and the caller's JSON object when the route parsed it (read once, for the session
key of :mod:`router.gateway.routing.affinity`). A body that cannot be parsed is forwarded as it
came: the worker answers 400 with its own message.
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from router.contract import endpoints as ep
from router.contract.endpoint import AnyEndpoint
from router.contract.vllm_tokens import REQUEST_ID_HEADER, REQUEST_ID_PREFIX
from router.gateway.routing.caller import Caller

#: Router-assigned rids: a random per-process prefix and a fixed-width counter, so no rid is a prefix of
#: another (workers abort by prefix) and none costs a system call (``uuid4`` reads ``os.urandom``).
_RID_PREFIX = f"omni-{secrets.token_hex(8)}"
_rid_counter = itertools.count()


def _new_rid() -> str:
    return f"{_RID_PREFIX}{next(_rid_counter):012x}"


class GenerateBody(NamedTuple):
    """A ``/generate`` (or OpenAI) body made ready to forward."""

    body: bytes
    rid: Any
    """The rid to abort with (a prefix of every rid of a batch), or ``None`` when the body did not parse."""
    stream: bool
    fields: dict[str, Any] | None
    """The caller's JSON object as parsed, or ``None``."""


class TokensBody(NamedTuple):
    """A vLLM ``/inference/v1/generate`` body made ready to forward."""

    body: bytes
    request_id: str | None
    """The id its worker runs it as (and aborts it by), or ``None`` when there is none to abort by."""
    fields: dict[str, Any] | None
    """The caller's JSON object when it is one (its ``model`` names a LoRA adapter)."""


def prepare_generate(raw: bytes) -> GenerateBody:
    """Inject a rid when none was given.

    The caller's object is left as it came (its own ``rid`` only), for the session key. A body that
    carries its rid is forwarded as it came. An injected rid is spliced in after the opening brace
    instead of re-encoding the whole body; a body where that is not a plain byte splice
    (``"rid": null`` present, ``{}``, not UTF-8 or a byte-order mark) is re-encoded.
    """
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return GenerateBody(raw, None, False, None)  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return GenerateBody(raw, None, False, None)
    stream = payload.get("stream") is True
    rid = payload.get("rid")
    if rid is not None:
        return GenerateBody(raw, rid, stream, payload)
    base = _new_rid()
    text = payload.get("text")
    if text is not None:
        batch = len(text) if isinstance(text, list) else None
    else:
        ids = payload.get("input_ids")
        batch = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else None
    # Abort by prefix: every assigned rid starts with ``base``.
    assigned: str | list[str] = base if batch is None else [f"{base}-{i}" for i in range(batch)]
    start = len(raw) - len(raw.lstrip())
    if payload and "rid" not in payload and raw[start : start + 1] == b"{":
        spliced = raw[: start + 1] + b'"rid": ' + json.dumps(assigned).encode() + b", " + raw[start + 1 :]
        return GenerateBody(spliced, base, stream, payload)
    return GenerateBody(json.dumps({**payload, "rid": assigned}).encode(), base, stream, payload)


def prepare_tokens_payload(raw: bytes, header_id: str | None) -> TokensBody:
    """vLLM's ``/inference/v1/generate``. The worker names it ``generate-tokens-<X-Request-Id |
    request_id>``; a body with neither (or an empty one) gets a ``request_id`` spliced in (re-encoded where that
    is not a plain byte splice), so the router can abort it."""
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return TokensBody(raw, None, None)  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return TokensBody(raw, None, None)
    if header_id:
        return TokensBody(raw, REQUEST_ID_PREFIX + header_id, payload)
    given = payload.get("request_id")
    if isinstance(given, str) and given:
        return TokensBody(raw, REQUEST_ID_PREFIX + given, payload)
    if given is not None and given != "":
        return TokensBody(raw, None, payload)  # not an id: the worker refuses the body
    base = _new_rid()
    start = len(raw) - len(raw.lstrip())
    if payload and "request_id" not in payload and raw[start : start + 1] == b"{":
        spliced = raw[: start + 1] + b'"request_id": ' + json.dumps(base).encode() + b", " + raw[start + 1 :]
        return TokensBody(spliced, REQUEST_ID_PREFIX + base, payload)
    return TokensBody(json.dumps({**payload, "request_id": base}).encode(), REQUEST_ID_PREFIX + base, payload)


@dataclass(frozen=True, slots=True)
class AbortCall:
    """How to stop a request on its worker once its caller went away: one call of a contract abort route."""

    endpoint: AnyEndpoint
    fields: dict[str, Any]
    """The abort request's fields: validated as ``endpoint.request`` only when an abort is sent, never
    for the requests that finish (nearly all of them)."""
    label: str


class Prepared(NamedTuple):
    """How a route's body is made ready to forward."""

    body: bytes
    abort: AbortCall | None
    """How to abort it, or ``None`` when there is nothing to abort by."""
    fields: dict[str, Any] | None
    """The caller's JSON object when the route parsed it (for the session key and the LoRA adapter it
    names), ``None`` otherwise."""


Prepare = Callable[[bytes, Caller[object]], Prepared]


def sglang_prepare(raw: bytes, _caller: Caller[object]) -> Prepared:
    """``/generate`` and the OpenAI routes: a ``rid`` (assigned when missing), aborted by prefix."""
    ready = prepare_generate(raw)
    rid = ready.rid
    abort = None if rid is None else AbortCall(ep.ABORT_REQUEST, {"rid": rid}, f"rid {rid}")
    return Prepared(ready.body, abort, ready.fields)


def tokens_prepare(raw: bytes, caller: Caller[object]) -> Prepared:
    """vLLM's ``/inference/v1/generate``: aborted by its id (``/abort_requests``: the call and its choices); routed
    by the LoRA adapter its ``model`` names, as the OpenAI routes are."""
    ready = prepare_tokens_payload(raw, caller.header(REQUEST_ID_HEADER))
    request_id = ready.request_id
    abort = (
        None
        if request_id is None
        else AbortCall(ep.ABORT_REQUESTS, {"request_ids": [request_id]}, f"request {request_id}")
    )
    return Prepared(ready.body, abort, ready.fields)


def passthrough(raw: bytes, _caller: Caller[object]) -> Prepared:
    """A route whose answer needs no generation (``/tokenize``): forwarded as it came, nothing to abort."""
    return Prepared(raw, None, None)
