"""LoRA adapters across the fleet, as :class:`~router.trainer.calls.RouterCalls` methods.

One call loads (or updates) an adapter on every worker of the fleet, or on none: the router rolls back
the workers that took it when one fails (docs/lora.md), and raises
:class:`~router.trainer.calls.RouterCallError` with every worker's result. Generation then names the
adapter by ``lora_path`` (``/generate``) or ``model`` (the OpenAI routes).
"""

from __future__ import annotations

from typing import Any, Unpack

from router.contract.fleet_adapters import FleetAdapterTable
from router.contract.fleet_answers import FleetAnswer
from router.contract.lora import (
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    LoraUpdateResult,
    UnloadLoraAdapterRequest,
)
from router.contract.lora_endpoints import LOAD_LORA_ADAPTER, LOAD_LORA_ADAPTER_FROM_TENSORS, UNLOAD_LORA_ADAPTER
from router.trainer.call_fields import LoraTensorsFields
from router.trainer.transport import Transport


class AdapterCalls(Transport):
    """The LoRA calls; the transport (``_admin``, ``_plain``) is :class:`~router.trainer.calls.RouterCalls`'."""

    def load_lora_adapter(
        self, name: str, path: str, *, expected_checksum: str | None = None
    ) -> FleetAnswer[LoraUpdateResult]:
        """Load the PEFT adapter directory ``path`` (on the workers' disks) as ``name`` on every worker, or on
        none; a ``name`` the fleet holds already is updated (its fleet version goes up by one).
        ``expected_checksum``: :func:`~router.trainer.digests.expected_adapter_checksum` of the adapter the
        trainer saved there; the load then succeeds only where every worker loaded exactly those tensors."""
        req = LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return self._admin(LOAD_LORA_ADAPTER, req, FleetAnswer[LoraUpdateResult], expected_checksum)

    def load_lora_adapter_from_tensors(
        self,
        name: str,
        config: dict[str, Any],
        serialized_named_tensors: list[str],
        *,
        expected_checksum: str | None = None,
        **fields: Unpack[LoraTensorsFields],
    ) -> FleetAnswer[LoraUpdateResult]:
        """SGLang's ``/load_lora_adapter_from_tensors`` on every worker, or on none: ``config`` is the
        adapter's ``adapter_config.json``, ``serialized_named_tensors`` one serialized tensor list per rank
        as SGLang's serializer writes it (the workers read it only with ``--allow-pickled-tensors``);
        ``expected_checksum`` as for :meth:`load_lora_adapter`."""
        req = LoadLoraAdapterFromTensorsRequest(
            lora_name=name, config_dict=config, serialized_named_tensors=serialized_named_tensors, **fields
        )
        return self._admin(LOAD_LORA_ADAPTER_FROM_TENSORS, req, FleetAnswer[LoraUpdateResult], expected_checksum)

    def unload_lora_adapter(self, name: str) -> FleetAnswer[LoraUpdateResult]:
        """Stop routing ``name``, let the requests naming it end, unload it from every worker that holds it."""
        return self._admin(UNLOAD_LORA_ADAPTER, UnloadLoraAdapterRequest(lora_name=name), FleetAnswer[LoraUpdateResult])

    def fleet_adapters(self) -> FleetAdapterTable:
        """The fleet's adapters: each one's fleet version, source and holders."""
        return self._plain("GET", "/fleet/adapters", FleetAdapterTable)
