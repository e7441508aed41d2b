"""Blocking client (stdlib ``urllib`` only, safe to call from trainer threads)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

from router.trainer.calls import RouterCalls, decode_response, unreachable
from router.trainer.driver import SyncReport, WeightSync


class RouterClient(RouterCalls):
    """Talk to one router URL, blocking. Constructor arguments: see :class:`RouterCalls`."""

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        except (urllib.error.URLError, OSError) as exc:
            raise unreachable(method, path, exc) from exc
        return decode_response(method, path, status, raw)

    def sync_weights(
        self,
        *,
        buckets: Sequence[dict[str, Any]],
        broadcast: Callable[[int], None],
        **options: Any,
    ) -> SyncReport:
        """Run one whole weight sync through the router; see :class:`WeightSync`."""
        return WeightSync(self, **options).run(buckets, broadcast)
