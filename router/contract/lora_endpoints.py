"""The LoRA routes of the worker contract, as SGLang and vLLM spell them (:mod:`router.contract.lora`).

A load reads a few megabytes (a path on the worker's disk, or tensors in the body) and touches no
base weight, so its budget is a load's, not a checkpoint's; loads and unloads are serialized by a
router so that every worker of a fleet goes through the same adapter changes in the same order.
"""

from __future__ import annotations

from router.contract import lora
from router.contract.budget import Budget
from router.contract.endpoint import POST, AnyEndpoint, Endpoint

LOAD_LORA_ADAPTER = Endpoint(
    "/load_lora_adapter",
    POST,
    lora.LoadLoraAdapterRequest,
    lora.LoraUpdateResult,
    Budget(120.0),
    serialized=True,
    timeout_field=None,
    summary="Load a PEFT LoRA adapter from a path (loading a loaded name again updates it)",
)
LOAD_LORA_ADAPTER_FROM_TENSORS = Endpoint(
    "/load_lora_adapter_from_tensors",
    POST,
    lora.LoadLoraAdapterFromTensorsRequest,
    lora.LoraUpdateResult,
    Budget(120.0),
    serialized=True,
    timeout_field=None,
    summary="Load a LoRA adapter sent as serialized tensors (with --allow-pickled-tensors)",
)
UNLOAD_LORA_ADAPTER = Endpoint(
    "/unload_lora_adapter",
    POST,
    lora.UnloadLoraAdapterRequest,
    lora.LoraUpdateResult,
    Budget(60.0),
    serialized=True,
    timeout_field=None,
    summary="Unload a LoRA adapter (requests already running with it finish with it)",
)
V1_LOAD_LORA_ADAPTER = Endpoint(
    "/v1/load_lora_adapter",
    POST,
    lora.VllmLoadLoraAdapterRequest,
    lora.VllmLoraResult,
    Budget(120.0),
    serialized=True,
    timeout_field=None,
    summary="Load a PEFT LoRA adapter from a path (vLLM; load_inplace updates a loaded name)",
)
V1_UNLOAD_LORA_ADAPTER = Endpoint(
    "/v1/unload_lora_adapter",
    POST,
    lora.VllmUnloadLoraAdapterRequest,
    lora.VllmLoraResult,
    Budget(60.0),
    serialized=True,
    timeout_field=None,
    summary="Unload a LoRA adapter (vLLM)",
)

#: Every LoRA route omni-worker serves, SGLang's and vLLM's.
LORA_ADMIN: tuple[AnyEndpoint, ...] = (
    LOAD_LORA_ADAPTER,
    LOAD_LORA_ADAPTER_FROM_TENSORS,
    UNLOAD_LORA_ADAPTER,
    V1_LOAD_LORA_ADAPTER,
    V1_UNLOAD_LORA_ADAPTER,
)
