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
from typing import Any

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


def prepare_payload(raw: bytes) -> tuple[bytes, Any, bool]:
    """Return (body to send, rid to abort with, stream?). Injects a rid when none was given."""
    body, rid, stream, _ = prepare_generate(raw)
    return body, rid, stream


def prepare_generate(raw: bytes) -> tuple[bytes, Any, bool, dict[str, Any] | None]:
    """Return (body to send, rid to abort with, stream?, the caller's JSON object as parsed, or ``None``).

    The caller's object is left as it came (its own ``rid`` only), for the session key. A body that
    carries its rid is forwarded as it came. An injected rid is spliced in after the opening brace
    instead of re-encoding the whole body; a body where that is not a plain byte splice
    (``"rid": null`` present, ``{}``, not UTF-8 or a byte-order mark) is re-encoded.
    """
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw, None, False, None  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return raw, None, False, None
    stream = payload.get("stream") is True
    rid = payload.get("rid")
    if rid is not None:
        return raw, rid, stream, payload
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
        return spliced, base, stream, payload
    return json.dumps({**payload, "rid": assigned}).encode(), base, stream, payload


def prepare_tokens_payload(raw: bytes, header_id: str | None) -> tuple[bytes, str | None, dict[str, Any] | None]:
    """vLLM's ``/inference/v1/generate``: (body to send, the id its worker runs it as, the caller's JSON object
    when it is one: its ``model`` names a LoRA adapter). The worker names it ``generate-tokens-<X-Request-Id |
    request_id>``; a body with neither (or an empty one) gets a ``request_id`` spliced in (re-encoded where that
    is not a plain byte splice), so the router can abort it."""
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw, None, None  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return raw, None, None
    if header_id:
        return raw, REQUEST_ID_PREFIX + header_id, payload
    given = payload.get("request_id")
    if isinstance(given, str) and given:
        return raw, REQUEST_ID_PREFIX + given, payload
    if given is not None and given != "":
        return raw, None, payload  # not an id: the worker refuses the body
    base = _new_rid()
    start = len(raw) - len(raw.lstrip())
    if payload and "request_id" not in payload and raw[start : start + 1] == b"{":
        spliced = raw[: start + 1] + b'"request_id": ' + json.dumps(base).encode() + b", " + raw[start + 1 :]
        return spliced, REQUEST_ID_PREFIX + base, payload
    return json.dumps({**payload, "request_id": base}).encode(), REQUEST_ID_PREFIX + base, payload


@dataclass(frozen=True, slots=True)
class AbortCall:
    """How to stop a request on its worker once its caller went away: one call of a contract abort route."""

    endpoint: AnyEndpoint
    fields: dict[str, Any]
    """The abort request's fields: validated as ``endpoint.request`` only when an abort is sent, never
    for the requests that finish (nearly all of them)."""
    label: str


#: How a route's body is made ready to forward: (body, how to abort it, or None when there is nothing to abort,
#: the caller's JSON object when the route parsed it, for the session key; None otherwise).
Prepared = tuple[bytes, AbortCall | None, dict[str, Any] | None]
Prepare = Callable[[bytes, Caller[object]], Prepared]


def sglang_prepare(raw: bytes, _caller: Caller[object]) -> Prepared:
    """``/generate`` and the OpenAI routes: a ``rid`` (assigned when missing), aborted by prefix."""
    body, rid, _, payload = prepare_generate(raw)
    return body, None if rid is None else AbortCall(ep.ABORT_REQUEST, {"rid": rid}, f"rid {rid}"), payload


def tokens_prepare(raw: bytes, caller: Caller[object]) -> Prepared:
    """vLLM's ``/inference/v1/generate``: aborted by its id (``/abort_requests``: the call and its choices); routed
    by the LoRA adapter its ``model`` names, as the OpenAI routes are."""
    body, request_id, payload = prepare_tokens_payload(raw, caller.header(REQUEST_ID_HEADER))
    abort = (
        None
        if request_id is None
        else AbortCall(ep.ABORT_REQUESTS, {"request_ids": [request_id]}, f"request {request_id}")
    )
    return body, abort, payload


def passthrough(raw: bytes, _caller: Caller[object]) -> Prepared:
    """A route whose answer needs no generation (``/tokenize``): forwarded as it came, nothing to abort."""
    return raw, None, None
