"""Asyncio client (aiohttp). ``sync_weights`` runs the blocking cycle in a thread,
so torch work in the caller's ``broadcast`` never runs on the event loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Sequence

import aiohttp

from router.trainer.calls import RouterCalls, decode_response, unreachable
from router.trainer.client import RouterClient
from router.trainer.driver import SyncReport


class AsyncRouterClient(RouterCalls):
    """Like :class:`RouterClient`, but every call is awaited. Use as ``async with``."""

    def __init__(self, url: str, *, admin_key: str | None = None, timeout_s: float = 120.0):
        super().__init__(url, admin_key=admin_key, timeout_s=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        # sync_weights runs the blocking cycle; one client for every sync, sharing
        # ``joined_groups``, so a joined group is initialized once, not once per sync.
        self._blocking = RouterClient(self.url, admin_key=admin_key, timeout_s=timeout_s)
        self._blocking.joined_groups = self.joined_groups

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        data = None if body is None else json.dumps(body).encode()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session.request(method, self.url + path, data=data, headers=self.headers(), timeout=timeout) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise unreachable(method, path, exc) from exc
        return decode_response(method, path, status, raw)

    async def sync_weights(self, *, buckets: Sequence[dict[str, Any]], broadcast: Callable[[int], None], **options: Any) -> SyncReport:
        """:meth:`RouterClient.sync_weights` on a thread (``broadcast`` and ``join`` run there too)."""
        return await asyncio.to_thread(self._blocking.sync_weights, buckets=buckets, broadcast=broadcast, **options)
