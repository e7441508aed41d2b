"""WorkerConfig: everything ``omni-worker`` is started with."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from router.contract.settings import Flag
from router.contract.web.auth import ADMIN_KEY_ENV

WEIGHT_TRANSFER_BACKENDS = ("torch", "nccl")


def weight_transfer_config(text: str) -> str:
    """``--weight-transfer-config``: vLLM's JSON form, or a bare backend name."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = {"backend": text}
    backend = data.get("backend") if isinstance(data, dict) else None
    if backend not in WEIGHT_TRANSFER_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object with backend one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}, got {text!r}"
        )
    return str(backend)


@dataclass(kw_only=True)
class WorkerConfig:
    """Settings of one worker process. A field annotated with a :class:`~router.contract.settings.Flag` is an
    ``omni-worker`` flag, with the field's default (:mod:`router.contract.settings`)."""

    model_path: Annotated[str, Flag("Hugging Face model directory (config.json + *.safetensors)")]
    host: Annotated[str, Flag("address to listen on")] = "127.0.0.1"
    port: Annotated[int, Flag("TCP port to listen on; 0 picks a free one")] = 30000
    device: Annotated[str, Flag("cpu, cuda or cuda:N")] = "cpu"
    dtype: Annotated[Literal["float32", "bfloat16"], Flag("dtype the weights are served in")] = "float32"
    admin_api_key: Annotated[str | None, Flag("bearer key for admin routes", env=ADMIN_KEY_ENV)] = None
    api_key: Annotated[
        str | None, Flag("bearer key for /generate (the admin key is accepted too)", empty_is_unset=True)
    ] = None
    max_running_requests: Annotated[int, Flag("requests decoded together in one batch; more wait in the queue")] = 32
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Flag("log verbosity")] = "info"
    served_model_name: Annotated[str | None, Flag("model name reported by /model_info; default: the model path")] = None
    health_check_timeout_s: float = 20.0
    num_threads: Annotated[
        int | None,
        Flag(
            "torch intra-op CPU threads (torch.set_num_threads); default: torch's choice, one per core. On a small "
            "CPU machine shared with a trainer or other workers, 1 keeps PyTorch's spinning OpenMP threads from "
            "starving the gloo transport of weight sync"
        ),
    ] = None
    tp_size: Annotated[
        int,
        Flag(
            "tensor-parallel ranks on this host: this process is rank 0 and starts the others (one GPU each on "
            "CUDA, gloo on CPU); the router gives the worker tp-size consecutive ranks in a weight-update group"
        ),
    ] = 1
    step_delay_s: Annotated[
        float,
        Flag(
            "testing aid: milliseconds to sleep after every forward step, so a tiny model behaves like a slow one "
            "and requests stay in flight long enough to be paused, retracted or aborted deterministically",
            name="--step-delay-ms",
            scale=1000.0,
        ),
    ] = 0.0
    shutdown_grace_s: Annotated[
        float,
        Flag(
            "seconds that generations in flight may run to completion after SIGTERM (new ones get 503, /health "
            "says draining) before the rest are aborted; keep it below Kubernetes' terminationGracePeriodSeconds "
            "minus about 15 s (leaving a weight-update group, stopping)"
        ),
    ] = 30.0
    fault_noop_updates: Annotated[
        bool,
        Flag(
            "testing aid: answer /update_weights_from_disk with success while loading the checkpoint the worker "
            "already holds instead of the one named (an update that moves nothing, as a weight transfer that "
            "soft-fails does): the fault a router's digest checks must catch"
        ),
    ] = False
    allow_pickled_tensors: Annotated[
        bool,
        Flag(
            "accept SGLang's pickled serialized_named_tensors on /update_weights_from_tensor (decoded by a "
            "restricted unpickler that still opens the shared memory the caller names); the JSON handle format "
            "is always accepted"
        ),
    ] = False
    snapshot_lease_wait_s: Annotated[
        float, Flag("how long a weight update waits for /weights_snapshot streams in flight before cutting them")
    ] = 10.0
    snapshot_send_delay_s: Annotated[
        float,
        Flag(
            "testing aid: milliseconds to sleep after each tensor a /weights_snapshot stream sends, so a transfer "
            "stays in flight long enough to be interrupted deterministically",
            name="--snapshot-send-delay-ms",
            scale=1000.0,
        ),
    ] = 0.0
    weight_transfer_backend: Annotated[
        str,
        Flag(
            'vLLM\'s spelling, e.g. \'{"backend": "nccl"}\': the group /init_weight_transfer_engine builds. '
            '"torch": a torch.distributed group (gloo on CPU, NCCL on CUDA), as for /init_weights_update_group; '
            '"nccl": vLLM\'s own NCCL engine rendezvous (a StatelessProcessGroup store and a bare NCCL '
            "communicator), which vLLM's trainer-side engine (TRL, SkyRL) joins; CUDA only",
            name="--weight-transfer-config",
            dest="weight_transfer_backend",
            metavar="JSON",
            parse=weight_transfer_config,
        ),
    ] = "torch"

    enable_lora: Annotated[
        bool,
        Flag(
            "serve LoRA adapters in PEFT's format: SGLang's /load_lora_adapter, /load_lora_adapter_from_tensors, "
            "/unload_lora_adapter and vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter; a request chooses "
            "one by lora_path (/generate) or model (OpenAI and token routes)"
        ),
    ] = False
    max_loras: Annotated[int, Flag("LoRA adapters loaded at once (with --enable-lora)")] = 4
    max_lora_rank: Annotated[int, Flag("the largest LoRA rank a load accepts (with --enable-lora)")] = 64

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting (the CUDA device is looked for too)."""
        for flag, value in (
            ("--max-running-requests", self.max_running_requests),
            ("--num-threads", self.num_threads),
            ("--tp-size", self.tp_size),
            ("--max-loras", self.max_loras),
            ("--max-lora-rank", self.max_lora_rank),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1")
        if not self.shutdown_grace_s >= 0:
            raise ValueError("--shutdown-grace-s must be >= 0")
        if self.device != "cpu":
            if not (self.device == "cuda" or self.device.startswith("cuda:")):
                raise ValueError(f"--device must be cpu, cuda or cuda:N, not {self.device!r}")
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda requested but no CUDA device is available")
        if self.weight_transfer_backend == "nccl" and self.device == "cpu":
            raise ValueError('--weight-transfer-config {"backend": "nccl"} needs a CUDA device (--device cuda)')

    def public_dict(self) -> dict[str, Any]:
        """The settings without secrets (for ``/server_info``)."""
        data = asdict(self)
        for key in ("admin_api_key", "api_key"):
            data[key] = None
            data[f"{key}_set"] = getattr(self, key) is not None
        return data
