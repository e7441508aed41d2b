"""The optional fields of the calls that take their request's fields as keywords.

``update_weights_from_disk``, ``update_weights_from_tensor`` and ``load_lora_adapter_from_tensors``
pass these keywords to their request model unchanged. Declared here as ``TypedDict`` s (as
:class:`~router.trainer.options.SyncOptions` declares ``sync_weights``' keywords) so that a type
checker checks each keyword a caller passes; the request model still validates the values.
``tests/test_trainer_call_fields.py`` keeps each in step with its model's fields.
"""

# No ``from __future__ import annotations``: a TypedDict's keys are read from evaluated annotations.
from typing import Any, TypedDict

from router.contract.tensor_handles import HandleMessage


class DiskUpdateFields(TypedDict, total=False):
    """:class:`~router.contract.admin.UpdateWeightsFromDiskRequest`'s fields after ``model_path``."""

    load_format: str | None
    abort_all_requests: bool
    weight_version: str | None
    is_async: bool
    torch_empty_cache: bool
    keep_pause: bool
    recapture_cuda_graph: bool
    token_step: int
    flush_cache: bool
    manifest: dict[str, Any] | None


class TensorUpdateFields(TypedDict, total=False):
    """:class:`~router.contract.admin.UpdateWeightsFromTensorRequest`'s fields: exactly one of
    ``serialized_named_tensors`` and ``tensor_handles`` carries the tensors (the body
    :func:`~router.trainer.tensor_handles.build_cpu_handles` writes holds the handle message's JSON form,
    which the model validates as it validates the wire's)."""

    serialized_named_tensors: list[str]
    load_format: str | None
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    tensor_handles: HandleMessage | None


class LoraTensorsFields(TypedDict, total=False):
    """:class:`~router.contract.lora.LoadLoraAdapterFromTensorsRequest`'s fields after ``lora_name``,
    ``config_dict`` and ``serialized_named_tensors``."""

    pinned: bool
    added_tokens_config: dict[str, int] | None
    lora_id: str | None
    load_format: str | None
    expected_checksums: dict[str, str] | None
