"""Blocking client (stdlib ``urllib`` only, safe to call from trainer threads)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from router.contract.base import WireResponse
from router.trainer.calls import Bucket, Call, RouterCalls, decode_answer, unreachable
from router.trainer.driver import SyncReport, WeightSync

A = TypeVar("A", bound=WireResponse)


class RouterClient(RouterCalls):
    """Talk to one router URL, blocking. Constructor arguments: see :class:`RouterCalls`."""

    def _call(self, call: Call[A]) -> A:
        req = urllib.request.Request(self.url + call.path, data=call.data(), method=call.method, headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=call.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        except (urllib.error.URLError, OSError) as exc:
            raise unreachable(call, exc) from exc
        return decode_answer(call, status, raw)

    def sync_weights(
        self, *, buckets: Sequence[Bucket], broadcast: Callable[[int], None], **options: Any
    ) -> SyncReport:
        """Run one whole weight sync through the router; see :class:`WeightSync`."""
        return WeightSync(self, **options).run(buckets, broadcast)
