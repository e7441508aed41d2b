"""Read a running router's fleet over ``GET /fleet/status``, the answer parsed into its contract model.

The router judges its workers itself (:mod:`router.gateway.status.verdict`); this client asks once
and shows that answer.

Blocking calls from the standard library only: ``omni-router status`` is a short-lived client, and
every wait is bounded by the caller's timeout (each connect and each read). Anything that keeps a
complete picture from being read raises :class:`Unreadable` with the reason in words.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from router.contract.errors import ErrorBody
from router.contract.fleet import ROUTER_ROLE_HEADER, STANDBY_ROLE
from router.contract.fleet_status import FleetStatus
from router.contract.web.auth import ADMIN_KEY_ENV

M = TypeVar("M", bound=BaseModel)

#: The most of an unparsable answer quoted back: enough to recognise it, never a whole page.
QUOTED_CHARS = 200


class Unreadable(Exception):
    """The router could not be asked, or refused, or answered something that is not its contract."""


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    standby: bool


class RouterReader:
    """The admin reads of one router, with the admin key when one is given."""

    def __init__(self, url: str, *, admin_key: str | None, timeout_s: float):
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = timeout_s

    def fleet_status(self) -> FleetStatus:
        """The router's fleet and its verdict on each worker, read at one moment (one request)."""
        return self.get("/fleet/status", FleetStatus)

    def get(self, path: str, model: type[M]) -> M:
        answer = self._request(path)
        if answer.status != 200:
            raise Unreadable(self._refusal(path, answer))
        return _parse(path, model, answer.body)

    def _request(self, path: str) -> _Answer:
        request = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        if self.admin_key is not None:
            request.add_header("Authorization", f"Bearer {self.admin_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return _Answer(response.status, response.read(), standby=False)
        except urllib.error.HTTPError as err:
            with err:
                body = err.read()
            return _Answer(err.code, body, standby=err.headers.get(ROUTER_ROLE_HEADER) == STANDBY_ROLE)
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise Unreadable(self._too_slow(path)) from None
            raise Unreadable(f"cannot reach the router at {self.url}: {_words(err.reason)}") from None
        except TimeoutError:
            raise Unreadable(self._too_slow(path)) from None
        except OSError as exc:  # a connection reset or closed mid-answer
            raise Unreadable(f"cannot read GET {path} from the router at {self.url}: {_words(exc)}") from None

    def _too_slow(self, path: str) -> str:
        return f"the router at {self.url} did not answer GET {path} within {self.timeout_s:g}s (--timeout-s)"

    def _refusal(self, path: str, answer: _Answer) -> str:
        message = _error_message(answer.body)
        if answer.status == 401:
            if self.admin_key is None:
                return (
                    f"the router requires an admin key: pass --admin-api-key or set {ADMIN_KEY_ENV} "
                    f"(GET {path} answered 401: {message})"
                )
            return f"the admin key was refused (GET {path} answered 401: {message})"
        if answer.standby:  # the message names the leader: this replica does not serve the registry
            return f"{message} (GET {path} answered 503; ask the leader)"
        return f"GET {path} answered {answer.status}: {message}"


def _parse(path: str, model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the body"
        raise Unreadable(
            f"GET {path} answered something that is not a {model.__name__} ({where}: {first['msg']}): {_quote(body)}"
        ) from None


def _error_message(body: bytes) -> str:
    """The router's ``error.message``, or the start of whatever else came back."""
    try:
        return ErrorBody.model_validate_json(body).error.message
    except ValidationError:
        return _quote(body) or "(no body)"


def _quote(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + "…"


def _words(reason: object) -> str:
    """An OS error as a person reads it (``Connection refused``), anything else as it prints."""
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__
