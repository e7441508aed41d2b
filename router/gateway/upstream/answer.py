"""A worker's whole answer, decoded once into its contract model or into why it is unusable.

Every whole-answer call the router makes to a worker (the admin fan-out, health probes, metadata
reads, aborts, ``/v1/models``) ends in a :class:`WorkerAnswer`, built by :func:`decode_answer`
from what came back, or from the transport error when nothing did. A body that does not parse
is never probed with ``dict.get``: the answer carries the parse failure as its ``error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pydantic import ValidationError

from router.contract.base import WireResponse
from router.contract.errors import ErrorBody

M = TypeVar("M", bound=WireResponse)


@dataclass(frozen=True, slots=True)
class WorkerAnswer(Generic[M]):
    """One worker's answer to one call.

    ``status`` is ``None`` when no answer came (unreachable, the deadline, a broken answer); then
    ``error`` says why. A 2xx answer has a ``body`` unless it did not parse (then ``error`` says
    how). A refusal keeps its body when it parses as the model (SGLang's admin failures do), and
    its ``error`` is the worker's ``error.message`` when it sent one.
    """

    status: int | None
    body: M | None
    error: str | None

    @property
    def value(self) -> M | None:
        """The body of a 2xx answer that parsed, else ``None``."""
        if self.status is not None and 200 <= self.status < 300 and self.error is None:
            return self.body
        return None


def decode_answer(model: type[M], status: int, raw: bytes) -> WorkerAnswer[M]:
    """``raw`` as ``model``, and why it is unusable if it is."""
    body: M | None = None
    problem: str | None = None
    try:
        body = model.model_validate_json(raw) if raw else None
    except ValidationError as exc:
        problem = f"{exc.error_count()} problem(s), first: {_first_problem(exc)}"
    if 200 <= status < 300:
        if body is None:
            what = "an empty body" if not raw else f"a body that is not a valid {model.__name__} ({problem})"
            return WorkerAnswer(status, None, f"answered {status} with {what}")
        return WorkerAnswer(status, body, None)
    # A refusal: SGLang's admin failures parse as the response model (success false); errors carry error.message.
    try:
        return WorkerAnswer(status, body, ErrorBody.model_validate_json(raw).error.message)
    except ValidationError:
        pass
    if body is not None:
        return WorkerAnswer(status, body, None)
    text = raw.decode("utf-8", errors="replace").strip()
    return WorkerAnswer(status, None, f"answered {status}" + (f": {text[:300]}" if text else ""))


def decode_plain(model: type[M], status: int, raw: bytes) -> WorkerAnswer[M]:
    """:func:`decode_answer` for SGLang's and vLLM's admin routes, which also answer success without JSON.

    A 2xx whose body is empty, JSON ``null`` or plain text (SGLang's ``/flush_cache``, ``/abort_request``,
    ``/release_memory_occupation``; vLLM's ``/sleep``, ``/collective_rpc``) is a success, since those servers
    answer a failure with an error status: the model's defaults with ``success`` true and the text as
    ``message``. A model that cannot be built without fields (a read that must say something) keeps the
    error, and so does a 2xx JSON object that is not the model."""
    answer = decode_answer(model, status, raw)
    if answer.body is not None or not 200 <= status < 300:
        return answer
    text = raw.strip()
    if text.startswith((b"{", b"[")):
        return answer
    fields: dict[str, object] = {"success": True} if "success" in model.model_fields else {}
    if text not in (b"", b"null"):
        fields["message"] = text.decode("utf-8", errors="replace")
    try:
        body = model.model_validate(fields)
    except ValidationError:
        return answer
    return WorkerAnswer(status, body, None)


class Decoder(Protocol):
    """How an engine's whole answers are decoded into their models: :func:`decode_answer` or :func:`decode_plain`."""

    def __call__(self, model: type[M], status: int, raw: bytes, /) -> WorkerAnswer[M]: ...


def unreachable(exc: BaseException, timeout_s: float) -> WorkerAnswer[M]:
    """No answer: the deadline passed, or the transport failed (:mod:`~router.gateway.upstream.transport`)."""
    if isinstance(exc, TimeoutError):
        return WorkerAnswer(None, None, f"no answer within {timeout_s:g}s")
    return WorkerAnswer(None, None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _first_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg')}"
