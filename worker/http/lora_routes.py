"""LoRA adapters at runtime, as SGLang and vLLM serve the calls (:mod:`router.contract.lora`).

SGLang's ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors`` and ``/unload_lora_adapter``
answer ``{success, error_message, loaded_adapters}``: 200, or 400 with ``success`` false and nothing
changed. vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer its plain-text
sentence, or its error envelope: 400 for a name already loaded without ``load_inplace``, 404 for an
unknown name. Loading a loaded name again through SGLang's routes (or vLLM's with ``load_inplace``)
updates the adapter (:mod:`worker.adapters`); the answer's ``lora_version`` counts its loads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.contract.errors import ApiError
from router.contract.lora import (
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    LoraUpdateResult,
    UnloadLoraAdapterRequest,
    VllmLoadLoraAdapterRequest,
    VllmUnloadLoraAdapterRequest,
)
from router.contract.lora_endpoints import (
    LOAD_LORA_ADAPTER,
    LOAD_LORA_ADAPTER_FROM_TENSORS,
    UNLOAD_LORA_ADAPTER,
    V1_LOAD_LORA_ADAPTER,
    V1_UNLOAD_LORA_ADAPTER,
)
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.adapters import AdapterService
from worker.http.admin_routes import endpoint_routes
from worker.http.keys import ADAPTERS
from worker.model.lora import LoadedLora, LoraLoadError, LoraNotFoundError

Change = Callable[[AdapterService], Awaitable[LoadedLora | None]]


async def _sglang_change(request: web.Request, name: str, change: Change) -> web.Response:
    """Run one adapter change and answer as SGLang does: what is loaded afterwards, success or not."""
    adapters = request.app[ADAPTERS]
    try:
        await change(adapters)
    except (LoraLoadError, LoraNotFoundError) as exc:
        return _refused(str(exc), adapters)
    except ApiError as exc:
        if exc.status != 400:
            raise
        return _refused(exc.message, adapters)
    done = LoraUpdateResult(
        success=True,
        error_message="",
        loaded_adapters=adapters.loaded(),
        lora_version=adapters.version(name),
        lora_checksum=adapters.checksum(name),
    )
    return web.json_response(done.model_dump(mode="json", exclude_none=True))


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, LoadLoraAdapterRequest)
    return await _sglang_change(request, body.lora_name, lambda a: a.load_path(body.lora_name, body.lora_path))


async def load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    body = await parse_body(request, LoadLoraAdapterFromTensorsRequest)
    return await _sglang_change(request, body.lora_name, lambda a: a.load_tensors(body))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, UnloadLoraAdapterRequest)
    return await _sglang_change(request, body.lora_name, lambda a: a.unload(body.lora_name))


def _refused(message: str, adapters: AdapterService) -> web.Response:
    failed = LoraUpdateResult(success=False, error_message=message, loaded_adapters=adapters.loaded()).failed(message)
    return web.json_response(failed.model_dump(mode="json", exclude_none=True), status=400)


def _vllm_text(text: str) -> web.Response:
    # vLLM answers its LoRA routes with a bare sentence and no media type of its own.
    return web.Response(text=text, content_type="text/plain")


async def v1_load_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, VllmLoadLoraAdapterRequest)
    adapters = request.app[ADAPTERS]
    if body.lora_name in adapters.loaded() and not body.load_inplace:
        raise ApiError(
            400,
            f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.",
        )
    try:
        await adapters.load_path(body.lora_name, body.lora_path)
    except LoraLoadError as exc:
        raise ApiError(400, str(exc)) from None
    return _vllm_text(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def v1_unload_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, VllmUnloadLoraAdapterRequest)
    try:
        await request.app[ADAPTERS].unload(body.lora_name)
    except LoraNotFoundError:
        raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.") from None
    return _vllm_text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


ROUTES: list[Route] = [
    *endpoint_routes(LOAD_LORA_ADAPTER, load_lora_adapter),
    *endpoint_routes(LOAD_LORA_ADAPTER_FROM_TENSORS, load_lora_adapter_from_tensors),
    *endpoint_routes(UNLOAD_LORA_ADAPTER, unload_lora_adapter),
    *(
        Route("POST", endpoint.path, handler, endpoint.summary, body=endpoint.request, media_type="text/plain")
        for endpoint, handler in (
            (V1_LOAD_LORA_ADAPTER, v1_load_lora_adapter),
            (V1_UNLOAD_LORA_ADAPTER, v1_unload_lora_adapter),
        )
    ),
]
