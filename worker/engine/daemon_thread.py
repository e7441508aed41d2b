"""Run a blocking call on a daemon thread of its own and await it with a bound.

For calls that may block in the kernel with no end in sight, such as a read from
a hung network mount. Such a call must not run on asyncio's default executor:
``asyncio.run`` waits for that executor's threads when it ends and the
interpreter joins them at exit, so one stuck call would keep the process alive
after SIGTERM, and a few would use up the executor. A daemon thread is never
waited for: at the bound the caller gets :class:`TimeoutError`, the call is told
to stop (the :class:`threading.Event` it was given is set; it checks it between
its blocking steps) and the thread is abandoned. It ends by itself once its
blocking call returns, and its result is dropped.

At shutdown :func:`abandon_pending` gives up every such call at once, so that
the request handlers awaiting them answer before the server stops waiting for
handlers (aiohttp waits up to twice its shutdown timeout for a busy handler).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_abandoned: set[threading.Thread] = set()
_pending: dict[asyncio.Future[Any], threading.Event] = {}
"""Calls being awaited, with the event that tells each to stop."""


class Abandoned(RuntimeError):
    """The call was given up before it ended because the process is shutting down."""


def abandon_pending(reason: str) -> int:
    """Give up every call awaited on the running loop: each caller gets :class:`Abandoned` now."""
    loop = asyncio.get_running_loop()
    count = 0
    for outcome, stop in list(_pending.items()):
        if outcome.get_loop() is loop and not outcome.done():
            stop.set()
            outcome.set_exception(Abandoned(reason))
            count += 1
    return count


def abandoned_threads() -> int:
    """Threads given up on by their caller that have not ended yet."""
    for thread in [t for t in _abandoned if not t.is_alive()]:
        _abandoned.discard(thread)
    return len(_abandoned)


async def run_on_daemon_thread(fn: Callable[[threading.Event], T], timeout_s: float, *, name: str) -> T:
    """``fn(stop)`` on a new daemon thread; its result, or :class:`TimeoutError` after ``timeout_s``.

    On a timeout, when the awaiting task is cancelled, or when :func:`abandon_pending`
    gives it up (:class:`Abandoned`), ``stop`` is set and the thread is left to end
    by itself; whatever it returns or raises then is dropped.
    """
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()
    stop = threading.Event()

    def target() -> None:
        try:
            result = fn(stop)
        except Exception as exc:
            _deliver(loop, outcome, partial(outcome.set_exception, exc))
        else:
            _deliver(loop, outcome, partial(outcome.set_result, result))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    _pending[outcome] = stop
    try:
        return await asyncio.wait_for(outcome, timeout_s)
    except (TimeoutError, asyncio.CancelledError, Abandoned) as exc:
        stop.set()
        if thread.is_alive():
            _abandoned.add(thread)
            why = f"no result within {timeout_s:g}s" if isinstance(exc, TimeoutError) else "its caller went away"
            log.warning(
                "%s: %s; its thread is left to end by itself (%d such threads alive)", name, why, abandoned_threads()
            )
        raise
    finally:
        _pending.pop(outcome, None)


def _deliver(loop: asyncio.AbstractEventLoop, outcome: asyncio.Future[Any], settle: Callable[[], None]) -> None:
    """From the thread: hand the outcome to the loop, unless the caller stopped waiting."""

    def on_loop() -> None:
        if not outcome.done():  # done: timed out or cancelled, and the result is dropped
            settle()

    try:
        loop.call_soon_threadsafe(on_loop)
    except RuntimeError:
        pass  # the loop is closed (the process is shutting down): nobody waits for this result
