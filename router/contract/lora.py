"""LoRA adapters at runtime, as SGLang and vLLM spell the calls.

SGLang (0.5.23): ``POST /load_lora_adapter``, ``/load_lora_adapter_from_tensors`` and
``/unload_lora_adapter`` answer ``{success, error_message, loaded_adapters}`` (200, or 400 when
``success`` is false); ``loaded_adapters`` maps every loaded name to its path (``__tensor__`` for
one sent as tensors). A request chooses an adapter with ``lora_path`` (the adapter's name) on
``/generate`` or ``"model": "<adapter>"`` / ``"<base>:<adapter>"`` on the OpenAI routes.

vLLM (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` answer 200 with a plain-text sentence, 400 (a name already loaded
without ``load_inplace``) or 404 (an unknown name) in vLLM's error envelope; a request chooses an
adapter with ``"model": "<adapter>"``.

SkyRL's vLLM server adds its own ``POST /skyrl/v1/load_lora_adapter {lora_name, lora_path | in_memory}``,
which SkyRL's ``RemoteInferenceClient`` posts to every server: vLLM's load with ``load_inplace`` (a name
loaded again is replaced), answered ``{"status": "ok", "lora_name", "lora_int_id"}``.

What this project adds: loading a name again is an *update* (SGLang refuses it; vLLM needs
``load_inplace``): the new adapter is built whole before it replaces the old one, and the name's
``lora_version`` counts the loads that succeeded. Answers generated with an adapter say which
version served them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from router.contract.admin import MAX_SERIALIZED_CHARS
from router.contract.base import Label, OutcomeResponse, PathText, WireRequest, WireResponse

#: An adapter's name: what requests choose it by (``model``, ``lora_path``).
LoraName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^\S+$")]
#: The path SGLang reports for an adapter that was sent as tensors.
TENSOR_SOURCE = "__tensor__"
#: Splits an adapter's name into its family and an immutable version: ``policy@v7`` (miles' convention). The
#: version lives in the name every engine already takes, so released clients and engines need no new field.
VERSION_SEPARATOR = "@"


def split_version(name: str) -> tuple[str, str] | None:
    """``(family, version)`` of a versioned adapter name (``policy@v7``), ``None`` for a plain one. The name is
    split at its last ``@``; a name with nothing on either side of it is not versioned."""
    family, sep, version = name.rpartition(VERSION_SEPARATOR)
    return (family, version) if sep and family and version else None


class LoadLoraAdapterRequest(WireRequest):
    """``POST /load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``): a PEFT directory on the worker's disk."""

    lora_name: LoraName
    lora_path: PathText
    pinned: bool = False
    lora_id: Label | None = None


class LoadLoraAdapterFromTensorsRequest(WireRequest):
    """``POST /load_lora_adapter_from_tensors`` (SGLang's ``LoadLoRAAdapterFromTensorsReqInput``).

    ``config_dict`` is the adapter's ``adapter_config.json``; ``serialized_named_tensors`` holds one
    serialized copy of the adapter's tensors per tensor-parallel rank, in the encoding of
    ``/update_weights_from_tensor`` (pickles, read only behind ``--allow-pickled-tensors`` and a
    restricted unpickler)."""

    lora_name: LoraName
    config_dict: dict[str, Any]
    serialized_named_tensors: Annotated[
        list[Annotated[str, Field(max_length=MAX_SERIALIZED_CHARS)]], Field(min_length=1, max_length=1024)
    ]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: Label | None = None
    load_format: Label | None = None
    expected_checksums: dict[str, Label] | None = None


class UnloadLoraAdapterRequest(WireRequest):
    """``POST /unload_lora_adapter`` (SGLang's ``UnloadLoRAAdapterReqInput``)."""

    lora_name: LoraName
    lora_id: Label | None = None


class LoraUpdateResult(OutcomeResponse):
    """SGLang's ``LoRAUpdateOutput``, the answer of all three SGLang routes, plus ``lora_version``:
    the version the named adapter is at after the call (``None`` once unloaded or never loaded),
    ``lora_checksum``: an omni-worker's checksum of the tensors it loaded for that version
    (``router.dataplane.digest.adapter_checksum``), and on a failure ``error.message`` beside
    ``error_message`` (the project's error shape)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
    lora_version: int | None = None
    lora_checksum: str | None = None

    @property
    def ok(self) -> bool:
        return self.success


class VllmLoadLoraAdapterRequest(WireRequest):
    """``POST /v1/load_lora_adapter`` (vLLM's ``LoadLoRAAdapterRequest``)."""

    lora_name: LoraName
    lora_path: PathText
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class VllmUnloadLoraAdapterRequest(WireRequest):
    """``POST /v1/unload_lora_adapter`` (vLLM's ``UnloadLoRAAdapterRequest``)."""

    lora_name: LoraName
    lora_int_id: int | None = Field(None, ge=0, le=2**31)


class VllmLoraResult(WireResponse):
    """vLLM's answer to its LoRA routes: 200 with a plain-text sentence (``Success: LoRA adapter 'X' added
    successfully.``), failures in vLLM's error envelope. ``success`` and ``message`` are how a router reads
    the text (:func:`~router.gateway.upstream.answer.decode_plain`)."""

    success: bool = True
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.success


SKYRL_LOAD_LORA_ADAPTER_PATH = "/skyrl/v1/load_lora_adapter"


class SkyrlLoadLoraAdapterRequest(WireRequest):
    """``POST /skyrl/v1/load_lora_adapter`` (SkyRL's vLLM server): a PEFT directory, or ``in_memory`` for
    tensors SkyRL staged in its own workers beforehand; exactly one of the two."""

    lora_name: LoraName
    lora_path: PathText | None = None
    in_memory: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> SkyrlLoadLoraAdapterRequest:
        if self.in_memory == (self.lora_path is not None):
            raise ValueError("'lora_name' plus exactly one of 'lora_path' or 'in_memory': true must be provided")
        return self


class SkyrlLoraLoaded(WireResponse):
    """SkyRL's answer to its load: the adapter's name and the id requests for it run under."""

    status: Literal["ok"] = "ok"
    lora_name: str
    lora_int_id: int
