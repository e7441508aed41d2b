"""The parts of vLLM's server surface that RL trainers read, besides the weight-transfer routes.

* ``GET /server_info?config_format=json`` — vLLM answers ``{"vllm_config": <VllmConfig as JSON>,
  "vllm_env": {...}, "system_env": {...}}``. Trainers read a few fields of ``vllm_config``:
  TRL checks ``weight_transfer_config`` is set before it joins a weight-transfer group, reads
  ``model_config.logprobs_mode`` for its importance-sampling correction, and ``lora_config`` and
  ``parallel_config.data_parallel_size`` to choose how adapters are synced. :class:`VllmConfigView`
  carries those and the other settings a reader would look for (dtype, context length, sizes).
  Asked without ``config_format`` the route keeps SGLang's shape; ``config_format=text`` gives
  ``vllm_config`` as one line of text, as vLLM does.
* ``POST /reset_prefix_cache`` — vLLM answers 200 ``{"success": bool}``: ``false`` while cached
  blocks are still held by running requests (the caller may retry), never an HTTP error for that.
  TRL and SkyRL call it after every weight sync.

Field names and value shapes follow vLLM's JSON dump of its config: dtypes as ``str(torch.dtype)``
(``"torch.bfloat16"``), absent sub-configs as ``null``. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from router.contract.base import WireRequest, WireResponse

#: vLLM's ``--logprobs-mode`` whose meaning this project's logprobs have: the log-softmax of the
#: temperature-scaled logits, before top-k / top-p filtering.
LOGPROBS_MODE = "processed_logprobs"


class VllmModelConfig(WireResponse):
    """``vllm_config.model_config``."""

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str
    """As vLLM writes a torch dtype: ``"torch.float32"``."""
    max_model_len: int | None = None
    logprobs_mode: str = LOGPROBS_MODE
    seed: int | None = None
    trust_remote_code: bool = False
    quantization: str | None = None
    enforce_eager: bool = True
    architectures: list[str] = Field(default_factory=list)


class VllmParallelConfig(WireResponse):
    """``vllm_config.parallel_config``. ``world_size`` is vLLM's: the ranks of one data-parallel
    replica (tensor × pipeline); a router reports its workers as data-parallel replicas."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    world_size: int = 1


class VllmWeightTransferConfig(WireResponse):
    """``vllm_config.weight_transfer_config`` (``--weight-transfer-config``): the backend that
    ``/init_weight_transfer_engine`` builds (see ``omni-worker --weight-transfer-config``)."""

    backend: str


class VllmConfigView(WireResponse):
    """``vllm_config``: the settings vLLM's config dump holds that a trainer reads. The model's
    settings sit under the JSON key ``model_config`` (a name pydantic reserves for itself, hence the
    alias)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)

    model: VllmModelConfig = Field(alias="model_config")
    parallel_config: VllmParallelConfig
    weight_transfer_config: VllmWeightTransferConfig | None = None
    lora_config: dict[str, Any] | None = None
    speculative_config: dict[str, Any] | None = None

    def summary(self) -> str:
        """``config_format=text``: one line, as vLLM prints its config."""
        m, p = self.model, self.parallel_config
        backend = self.weight_transfer_config.backend if self.weight_transfer_config else None
        return (
            f"model={m.model!r}, served_model_name={m.served_model_name!r}, dtype={m.dtype}, "
            f"max_seq_len={m.max_model_len}, tensor_parallel_size={p.tensor_parallel_size}, "
            f"pipeline_parallel_size={p.pipeline_parallel_size}, data_parallel_size={p.data_parallel_size}, "
            f"weight_transfer_backend={backend}"
        )


ConfigFormat = Literal["text", "json"]


class ServerInfoRequest(WireRequest):
    """``GET /server_info``: SGLang's shape, or vLLM's when ``config_format`` is given."""

    config_format: ConfigFormat | None = None


class ResetPrefixCacheRequest(WireRequest):
    """``POST /reset_prefix_cache`` (vLLM's query parameters). ``reset_running_requests`` is
    accepted, but requests that are running keep their cache here: the reset then reports
    ``success: false`` until they end, as vLLM does without the flag. ``reset_external``
    (a connector's cache) has nothing to act on."""

    reset_running_requests: bool = False
    reset_external: bool = False


class ResetPrefixCacheResult(WireResponse):
    """vLLM's answer: 200 ``{"success": bool}``. A reset refused because requests still hold
    cache is an answered call (``success: false``, the caller may retry), not a failed one."""

    success: bool
    message: str = ""
