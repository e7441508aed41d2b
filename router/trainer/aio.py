"""Asyncio client (aiohttp). Its methods are :class:`RouterCalls`' methods, awaited.

``sync_weights`` runs the blocking cycle in a thread, so torch work in the
caller's ``broadcast`` never runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, Unpack

import aiohttp

from router.contract.base import WireResponse
from router.contract.budget import DEFAULT_LOCK_WAIT_S
from router.contract.fleet import ROUTER_ROLE_HEADER, STANDBY_ROLE
from router.contract.weight_sync import BucketMetadata
from router.trainer.calls import Call, RouterCalls, decode_answer, unreachable
from router.trainer.client import RouterClient
from router.trainer.driver import SyncReport
from router.trainer.failover import (
    DEFAULT_FAILOVER_BUDGET_S,
    StandbyAnswered,
    TransportFailed,
    through_failover_async,
)
from router.trainer.options import SyncOptions

A = TypeVar("A", bound=WireResponse)


class AsyncRouterClient(RouterCalls):
    """Like :class:`RouterClient`, but every call method returns an awaitable of its answer.

    Use as ``async with``. The methods are declared by :class:`RouterCalls` with the
    answer's type; :meth:`call` is the same transport with its awaitable type
    spelled out, for callers that type-check.
    """

    def __init__(
        self,
        url: str,
        *,
        admin_key: str | None = None,
        lock_wait_s: float = DEFAULT_LOCK_WAIT_S,
        failover_budget_s: float = DEFAULT_FAILOVER_BUDGET_S,
    ):
        super().__init__(url, admin_key=admin_key, lock_wait_s=lock_wait_s, failover_budget_s=failover_budget_s)
        self._session: aiohttp.ClientSession | None = None
        # sync_weights runs the blocking cycle; one client for every sync, sharing
        # ``joined_groups``, so a joined group is initialized once, not once per sync.
        self._blocking = RouterClient(
            self.url, admin_key=admin_key, lock_wait_s=lock_wait_s, failover_budget_s=failover_budget_s
        )
        self._blocking.joined_groups = self.joined_groups

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _call(self, call: Call[A]) -> A:
        # Each method of RouterCalls returns what _call returns: here, the coroutine of call().
        return self.call(call)  # type: ignore[return-value]

    def call(self, call: Call[A]) -> Coroutine[Any, Any, A]:
        return self._send(call)

    async def _send(self, call: Call[A]) -> A:
        try:
            status, raw = await through_failover_async(
                self.failover_budget_s, call.method, call.path, lambda: self._exchange(call)
            )
        except StandbyAnswered as refused:  # the budget ran out on standbys: their 503 is the answer
            status, raw = refused.status, refused.raw
        except TransportFailed as failed:
            raise unreachable(call, failed.cause) from failed.cause
        return decode_answer(call, status, raw)

    async def _exchange(self, call: Call[A]) -> tuple[int, bytes]:
        """One HTTP exchange: (status, body), or :class:`StandbyAnswered` / :class:`TransportFailed`."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=call.timeout_s)
        try:
            async with self._session.request(
                call.method,
                self.url + call.target,
                data=call.data(),
                headers={**self.headers(), **dict(call.headers)},
                timeout=timeout,
            ) as resp:
                status, raw, role = resp.status, await resp.read(), resp.headers.get(ROUTER_ROLE_HEADER)
        except aiohttp.ClientConnectorError as exc:  # no connection was made: nothing was sent
            raise TransportFailed(exc, maybe_sent=False) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportFailed(exc, maybe_sent=True) from exc
        if status == 503 and role == STANDBY_ROLE:
            raise StandbyAnswered(status, raw)
        return status, raw

    async def sync_weights(
        self, *, buckets: Sequence[BucketMetadata], broadcast: Callable[[int], None], **options: Unpack[SyncOptions]
    ) -> SyncReport:
        """:meth:`RouterClient.sync_weights` on a thread (``broadcast`` and ``join`` run there too)."""
        return await asyncio.to_thread(self._blocking.sync_weights, buckets=buckets, broadcast=broadcast, **options)
