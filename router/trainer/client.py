"""Blocking client (stdlib ``urllib`` only, safe to call from trainer threads)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import TypeVar, Unpack

from router.contract.base import WireResponse
from router.contract.fleet import ROUTER_ROLE_HEADER, STANDBY_ROLE
from router.contract.weight_sync import BucketMetadata
from router.trainer.calls import Call, RouterCalls, decode_answer, unreachable
from router.trainer.driver import SyncReport, WeightSync
from router.trainer.failover import StandbyAnswered, TransportFailed, never_connected, through_failover
from router.trainer.options import SyncOptions

A = TypeVar("A", bound=WireResponse)


class RouterClient(RouterCalls):
    """Talk to one router URL, blocking. Constructor arguments: see :class:`RouterCalls`."""

    def _call(self, call: Call[A]) -> A:
        try:
            status, raw = through_failover(self.failover_budget_s, call.method, call.path, lambda: self._send(call))
        except StandbyAnswered as refused:  # the budget ran out on standbys: their 503 is the answer
            status, raw = refused.status, refused.raw
        except TransportFailed as failed:
            raise unreachable(call, failed.cause) from failed.cause
        return decode_answer(call, status, raw)

    def _send(self, call: Call[A]) -> tuple[int, bytes]:
        """One HTTP exchange: (status, body), or :class:`StandbyAnswered` / :class:`TransportFailed`."""
        req = urllib.request.Request(
            self.url + call.target,
            data=call.data(),
            method=call.method,
            headers={**self.headers(), **dict(call.headers)},
        )
        try:
            with urllib.request.urlopen(req, timeout=call.timeout_s) as resp:
                status, raw, role = resp.status, resp.read(), resp.headers.get(ROUTER_ROLE_HEADER)
        except urllib.error.HTTPError as err:
            status, raw, role = err.code, err.read(), err.headers.get(ROUTER_ROLE_HEADER)
        except (urllib.error.URLError, OSError) as exc:
            raise TransportFailed(exc, maybe_sent=not never_connected(exc)) from exc
        if status == 503 and role == STANDBY_ROLE:
            raise StandbyAnswered(status, raw)
        return status, raw

    def sync_weights(
        self, *, buckets: Sequence[BucketMetadata], broadcast: Callable[[int], None], **options: Unpack[SyncOptions]
    ) -> SyncReport:
        """Run one whole weight sync through the router: ``group`` and :class:`WeightSync`'s other
        keywords (:class:`~router.trainer.options.SyncOptions`)."""
        return WeightSync(self, **options).run(buckets, broadcast)
