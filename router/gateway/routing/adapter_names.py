"""The body forwarded for a request that named an adapter without its version: it names the version instead.

The router resolves ``lora_path: "policy"`` (``/generate``) or ``model: "policy"`` (the OpenAI routes, vLLM's
token route; SGLang's ``<base>:policy`` too) to the version that serves it (``policy@v7``,
:mod:`router.gateway.fleet.adapter_versions`), and the worker, which holds each version under its own name,
must be told that name: it then runs the request with that version and says so in its answer
(``meta_info.lora_name``). Only such bodies are parsed again and re-encoded; every other body is forwarded
as it was prepared.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def renamed_body(body: bytes, renamed: Mapping[str, str]) -> bytes:
    """``body`` with each adapter name of ``renamed`` replaced where a request names adapters."""
    payload: dict[str, Any] = json.loads(body)  # the caller's body parsed already: it is a JSON object
    lora_path = payload.get("lora_path")
    if isinstance(lora_path, str):
        payload["lora_path"] = renamed.get(lora_path, lora_path)
    elif isinstance(lora_path, list):
        payload["lora_path"] = [renamed.get(n, n) if isinstance(n, str) else n for n in lora_path]
    model = payload.get("model")
    if isinstance(model, str):
        if model in renamed:
            payload["model"] = renamed[model]
        else:
            base, sep, tail = model.partition(":")
            if sep and tail in renamed:
                payload["model"] = f"{base}:{renamed[tail]}"
    return json.dumps(payload).encode()
