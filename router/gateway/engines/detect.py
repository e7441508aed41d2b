"""Which engine serves a worker URL, when the operator did not say (``--worker-engine auto``).

Read once, when the worker is registered, and again at each probe until it answers:

1. ``GET /health`` (open on every engine) answers JSON with a process identity (``instance_id``) → omni
   (vLLM's and SGLang's answer an empty body);
2. ``GET /model_info`` answers with omni-worker's ``instance_id`` → omni; with SGLang's fields
   (``model_path`` and ``weight_version``) and no ``instance_id`` → sglang;
3. otherwise ``GET /version`` answers ``{"version": ...}`` (vLLM serves it always, dev mode or not) → vllm.

Nothing here changes the worker; an answer that fits none of them leaves the engine unknown, and the
worker is not routed until it is known (``GET /workers`` says why).
"""

from __future__ import annotations

from router.contract.base import WireResponse
from router.contract.fleet import EngineName
from router.gateway.upstream import WorkerClient


class _AnyFields(WireResponse):
    """Whatever ``/health`` or ``/model_info`` answered, read for the keys that tell the engines apart."""


class _VersionAnswer(WireResponse):
    version: str


OMNI_KEYS = frozenset({"instance_id"})
SGLANG_KEYS = frozenset({"model_path", "weight_version"})


async def detect(
    client: WorkerClient, url: str, headers: dict[str, str], timeout_s: float
) -> tuple[EngineName | None, str]:
    """The engine at ``url`` and how it was told (or why it could not be)."""
    health = await client.fetch(url, "/health", _AnyFields, headers={}, timeout_s=timeout_s)
    if health.status is None:
        return None, f"not reachable: {health.error}"
    if health.value is not None and set(health.value.model_extra or {}) >= OMNI_KEYS:
        return "omni", "GET /health has omni-worker's fields"
    info = await client.fetch(url, "/model_info", _AnyFields, headers=headers, timeout_s=timeout_s)
    if info.status is None:
        return None, f"not reachable: {info.error}"
    if info.value is not None:
        keys = set(info.value.model_extra or {})
        if keys >= OMNI_KEYS:
            return "omni", "GET /model_info has omni-worker's fields"
        if keys >= SGLANG_KEYS:
            return "sglang", "GET /model_info has SGLang's fields"
    version = await client.fetch(url, "/version", _VersionAnswer, headers=headers, timeout_s=timeout_s)
    if version.value is not None:
        return "vllm", f"GET /version answers vLLM's {version.value.version!r}"
    return None, (
        f"neither omni-worker, SGLang nor vLLM: /model_info answered {info.status}, /version {version.status}; "
        "register it with an explicit engine"
    )
