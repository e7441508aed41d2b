"""Sending a router call again through a failover of the router's leader (``omni-router --leader-election``).

While a standby takes over (a lease duration, 15 s by default), the trainer's one URL reaches either
no router at all or a replica that does not lead. A call is sent again only when its answer proves
that nothing ran:

* a 503 carrying ``X-Omni-Router-Role: standby``: a standby refused it before running anything;
* a connection refused (or no route to the host, or a name that does not resolve) before a byte of
  the request was sent.

A call that may have reached a leader (a timeout, a connection reset or closed after the request was
sent) is sent again only when it is a ``GET``, a read. Everything else is the caller's to judge:
an admin call is never repeated blindly. The retries are bounded by one failover budget per call
(``failover_budget_s``, default :data:`DEFAULT_FAILOVER_BUDGET_S`; 0 sends once), spaced by jittered
exponential back-off (tenacity); past the budget the last answer or error is the call's.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long one call may keep trying through a failover: a lease duration (15 s) plus room for the takeover.
DEFAULT_FAILOVER_BUDGET_S = 30.0
#: The back-off between tries: from this, doubling, jittered ...
BACKOFF_INITIAL_S = 0.2
#: ... up to this (about a standby's retry period, so a new leader is found soon after it serves).
BACKOFF_MAX_S = 2.0
#: Connection errors that happen before a connection exists, hence before a byte is sent.
_NOT_CONNECTED = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


class StandbyAnswered(Exception):
    """A standby replica refused the call (503, ``X-Omni-Router-Role: standby``): nothing ran."""

    def __init__(self, status: int, raw: bytes):
        super().__init__(f"HTTP {status} from a standby router replica")
        self.status = status
        self.raw = raw


class TransportFailed(Exception):
    """No HTTP answer. ``maybe_sent``: the request may have reached the router (only a read is sent again)."""

    def __init__(self, cause: BaseException, *, maybe_sent: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.maybe_sent = maybe_sent


def never_connected(exc: BaseException) -> bool:
    """Whether an ``OSError`` (or what it wraps) says the connection was never made."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes is short; a bound keeps a cycle harmless
        if seen is None:
            break
        if isinstance(seen, (ConnectionRefusedError, socket.gaierror)):
            return True
        if isinstance(seen, OSError) and seen.errno in _NOT_CONNECTED:
            return True
        reason = getattr(seen, "reason", None)  # urllib's URLError wraps the socket's error
        seen = reason if isinstance(reason, BaseException) else seen.__cause__
    return False


def may_send_again(method: str, exc: BaseException) -> bool:
    if isinstance(exc, StandbyAnswered):
        return True
    if isinstance(exc, TransportFailed):
        return not exc.maybe_sent or method == "GET"
    return False


def _note(method: str, path: str) -> Callable[[RetryCallState], None]:
    def note(state: RetryCallState) -> None:
        outcome = state.outcome
        why = outcome.exception() if outcome is not None else None
        log.info("%s %s: %s; trying again through the failover (try %d)", method, path, why, state.attempt_number)

    return note


def through_failover(budget_s: float, method: str, path: str, send: Callable[[], T]) -> T:
    """``send()`` until it returns, raises something not worth sending again, or the budget is spent."""
    retrying = Retrying(
        stop=stop_after_delay(budget_s),
        wait=wait_exponential_jitter(initial=BACKOFF_INITIAL_S, max=BACKOFF_MAX_S, jitter=BACKOFF_INITIAL_S),
        retry=retry_if_exception(lambda exc: may_send_again(method, exc)),
        before_sleep=_note(method, path),
        reraise=True,
    )
    return retrying(send)


async def through_failover_async(budget_s: float, method: str, path: str, send: Callable[[], Awaitable[T]]) -> T:
    """:func:`through_failover` for a coroutine (the waits are ``asyncio.sleep``)."""
    retrying = AsyncRetrying(
        stop=stop_after_delay(budget_s),
        wait=wait_exponential_jitter(initial=BACKOFF_INITIAL_S, max=BACKOFF_MAX_S, jitter=BACKOFF_INITIAL_S),
        retry=retry_if_exception(lambda exc: may_send_again(method, exc)),
        before_sleep=_note(method, path),
        reraise=True,
    )

    async def attempt() -> T:  # a coroutine function, which tenacity awaits (a lambda's coroutine it would not)
        return await send()

    return await retrying(attempt)
