"""Bounded waits for tests: poll a condition until it holds, or fail naming it.

A test waits for a state to change (a process up, a request running, an event processed)
with one of these, never with a bare sleep: ``wait_for`` from threads and plain test code,
``until`` on an event loop. Both return as soon as the condition holds, so the bound is only
reached when the behaviour under test is broken.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Protocol


class _HasLog(Protocol):
    def log_text(self, tail: int = ...) -> str: ...


def wait_for(cond: Callable[[], bool], timeout: float, proc: _HasLog | None = None, what: str = "condition") -> None:
    """Poll ``cond`` every 0.1 s for at most ``timeout`` seconds; ``TimeoutError`` (with ``proc``'s log) past it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    log = proc.log_text() if proc is not None else ""
    raise TimeoutError(f"{what} not reached within {timeout}s\n{log}")


async def until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 10.0,
    what: str = "condition",
    *,
    interval_s: float = 0.01,
) -> None:
    """Poll ``predicate`` (plain or async) on the running loop for at most ``timeout_s`` seconds.

    Checked once before the first pause, so a condition that already holds returns at once;
    past the bound an ``AssertionError`` names ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(interval_s)


__all__ = ["until", "wait_for"]
