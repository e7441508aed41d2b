"""One method per router admin call, shared by the sync and async clients.

Each method builds its request and hands it to ``self._request``; the sync
client's ``_request`` returns the parsed body, the async client's returns a
coroutine. Both transports build headers with :meth:`RouterCalls.headers` and
turn the answer into a result with :func:`decode_response`, so a non-2xx answer
raises the same :class:`RouterCallError` (status, message and the per-worker
results the router returned) whichever client made the call.
"""

from __future__ import annotations

import json
from typing import Any, Sequence
from urllib.parse import quote


class RouterCallError(RuntimeError):
    """A router call answered non-2xx (or could not be made)."""

    def __init__(self, method: str, path: str, status: int | None, body: Any):
        self.method = method
        self.path = path
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> {status}: {self.message}")

    @property
    def message(self) -> str:
        b = self.body
        if isinstance(b, dict):
            if isinstance(b.get("error"), dict):
                return str(b["error"].get("message"))
            if "message" in b:
                return str(b["message"])
        return str(b)

    @property
    def results(self) -> list[dict[str, Any]]:
        """Per-worker results of a failed broadcast (empty for non-broadcast errors)."""
        b = self.body
        return list(b.get("results") or []) if isinstance(b, dict) else []

    def failed_workers(self) -> list[str]:
        return [r.get("worker", "?") for r in self.results if not r.get("success")]


def decode_response(method: str, path: str, status: int, raw: bytes) -> Any:
    """The parsed body of a 2xx answer (JSON, else text, ``None`` when empty); raise otherwise."""
    try:
        parsed = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = raw.decode("utf-8", errors="replace")
    if not 200 <= status < 300:
        raise RouterCallError(method, path, status, parsed)
    return parsed


def unreachable(method: str, path: str, exc: BaseException) -> RouterCallError:
    """The error for a call that got no HTTP answer at all (refused, reset, timed out)."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)  # a timeout's str() is empty
    return RouterCallError(method, path, None, {"error": {"message": f"router unreachable: {detail}"}})


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class RouterCalls:
    """The router's HTTP surface as methods (transport supplied by the subclass).

    Args:
        url: the router's base URL (a trailing ``/`` is dropped).
        admin_key: sent as ``Authorization: Bearer`` on every call.
        timeout_s: the HTTP timeout of a call that does not set its own.
    """

    def __init__(self, url: str, *, admin_key: str | None = None, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = timeout_s
        self.joined_groups: set[str] = set()
        """Names of the weight-update groups this trainer has joined as rank 0 through this
        client. ``sync_weights`` initializes a group not in it (asking the router for ranks,
        calling ``GroupSpec.join``) and removes a group whose sync failed after it was
        joined, so that the next sync rebuilds it."""

    def headers(self) -> dict[str, str]:
        """Headers for every call: JSON, and the admin key as ``Authorization: Bearer``."""
        out = {"Content-Type": "application/json"}
        if self.admin_key:
            out["Authorization"] = f"Bearer {self.admin_key}"
        return out

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    # -- generation control
    def pause_generation(self, mode: str = "retract") -> Any:
        return self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> Any:
        return self._request("POST", "/continue_generation", {})

    def abort_request(self, rid: str | list[str] | None = None, abort_all: bool = False) -> Any:
        return self._request("POST", "/abort_request", _drop_none({"rid": rid, "abort_all": abort_all}))

    def flush_cache(self) -> Any:
        return self._request("POST", "/flush_cache", {})

    # -- weights
    def update_weights_from_disk(self, model_path: str, **fields: Any) -> Any:
        return self._request("POST", "/update_weights_from_disk", {"model_path": model_path, **fields}, timeout_s=1900)

    def update_weights_from_tensor(self, **fields: Any) -> Any:
        return self._request("POST", "/update_weights_from_tensor", fields)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str | None = None,
        rank_offset: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        body = _drop_none({
            "master_address": master_address, "master_port": master_port, "world_size": world_size,
            "group_name": group_name, "backend": backend, "rank_offset": rank_offset, "timeout_s": timeout_s,
        })  # fmt: skip
        return self._request("POST", "/init_weights_update_group", body, timeout_s=(timeout_s or 900) + 60)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        return self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def get_world_size(self) -> Any:
        return self._request("GET", "/get_world_size")

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> Any:
        body = _drop_none({
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, "timeout_s": timeout_s,
        })  # fmt: skip
        return self._request("POST", "/update_weights_from_distributed", body, timeout_s=(timeout_s or 1800) + 60)

    def prepare_weights_update(
        self,
        buckets: Sequence[dict[str, Any]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        weight_version: str | None = None,
        atomic: bool | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        body = _drop_none({
            "num_buckets": len(buckets), "buckets": list(buckets), "group_name": group_name,
            "load_format": load_format, "weight_version": weight_version, "atomic": atomic, "timeout_s": timeout_s,
        })  # fmt: skip
        return self._request("POST", "/prepare_weights_update", body, timeout_s=(timeout_s or 600) + 60)

    def complete_weights_update(
        self, *, group_name: str = "weight_update_group", flush_cache: bool = False, weight_version: str | None = None,
        return_checksum: bool | None = None, timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        body = _drop_none({
            "group_name": group_name, "flush_cache": flush_cache, "weight_version": weight_version,
            "return_checksum": return_checksum, "timeout_s": timeout_s,
        })  # fmt: skip
        return self._request("POST", "/complete_weights_update", body, timeout_s=(timeout_s or 1800) + 60)

    def abort_weights_update(self, group_name: str = "weight_update_group") -> Any:
        return self._request("POST", "/abort_weights_update", {"group_name": group_name})

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Any:
        return self._request("POST", "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._request("POST", "/release_memory_occupation", _drop_none({"tags": tags}))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._request("POST", "/resume_memory_occupation", _drop_none({"tags": tags}))

    # -- fleet reads
    def model_info(self) -> Any:
        return self._request("GET", "/model_info")

    def get_weight_version(self) -> Any:
        return self._request("GET", "/get_weight_version")

    def server_info(self) -> Any:
        return self._request("GET", "/server_info")

    def weights_checker(self, action: str = "checksum") -> Any:
        return self._request("POST", "/weights_checker", {"action": action}, timeout_s=960)

    # -- registry
    def list_workers(self) -> Any:
        return self._request("GET", "/workers")

    def add_worker(self, url: str, disabled: bool = False) -> Any:
        return self._request("POST", "/workers", {"url": url, "disabled": disabled})

    def remove_worker(self, worker: str) -> Any:
        return self._request("DELETE", f"/workers/{quote(worker, safe='')}")

    def set_worker_disabled(self, worker: str, disabled: bool) -> Any:
        return self._request("PUT", f"/workers/{quote(worker, safe='')}", {"disabled": disabled})

    def update_journal(self) -> Any:
        return self._request("GET", "/weight_update_journal")

    def resolve_update_journal(self) -> Any:
        return self._request("POST", "/weight_update_journal/resolve", {"acknowledge": True})
