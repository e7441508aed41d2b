"""A blocking call that must be in flight while this thread does its own part of a rendezvous.

Joining a weight-update group and SGLang's single-phase update both block until
every rank meets: the HTTP call that makes the workers join (or receive) must
run while the trainer joins (or broadcasts) itself. :func:`alongside` runs the
call on a daemon thread, does the local part here, and waits for the call with
a bound. The sync driver and hand-written trainers share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``fn()`` on a daemon thread; its value or its error handed back to the caller's thread."""

    def __init__(
        self, fn: Callable[[], T], *, name: str = "omni-background-call", on_error: threading.Event | None = None
    ):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = False

        def run() -> None:
            try:
                self._value = fn()
                self._done = True
            except BaseException as exc:
                self._error = exc
                if on_error is not None:
                    on_error.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def result(self, timeout_s: float, on_timeout: str) -> T:
        """Wait up to ``timeout_s``; the value, the call's error raised, or ``TimeoutError(on_timeout)``."""
        self._thread.join(timeout_s)
        if self._error is not None:
            raise self._error
        if self._thread.is_alive() or not self._done:
            raise TimeoutError(on_timeout)
        return self._value  # type: ignore[return-value]


def alongside(
    remote: Callable[[], T],
    local: Callable[[], object],
    *,
    timeout_s: float,
    what: str,
    settle_on_failure: bool = True,
    remote_failed: threading.Event | None = None,
) -> T:
    """Run ``remote`` on a thread while ``local`` runs here; ``remote``'s value once both are done.

    ``remote`` gets at most ``timeout_s``. If ``local`` fails, its error is raised;
    with ``settle_on_failure`` only after ``remote`` has had ``timeout_s`` to answer
    (a join: the peers must not be left mid-rendezvous), else at once (a broadcast
    that never started: the receivers give up on their own deadline).

    ``remote_failed`` is set the moment ``remote`` raises, so a ``local`` that watches
    it (a join: ``TrainerWeightSender.join(cancel=...)``) stops waiting for peers that
    will not come; ``remote``'s error is then the one raised.
    """
    call = Background(remote, name=f"omni-{what}", on_error=remote_failed)
    try:
        local()
    except BaseException:
        if remote_failed is not None and remote_failed.is_set():
            call.result(0.0, f"{what} failed")  # raises the remote's error: the cause, not the cancelled join
        if settle_on_failure:
            try:
                call.result(timeout_s, f"{what} did not answer in time")
            except BaseException:
                pass
        raise
    return call.result(timeout_s, f"{what} did not answer within {timeout_s:g}s")
