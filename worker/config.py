"""WorkerConfig: everything ``omni-worker`` is started with."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(kw_only=True)
class WorkerConfig:
    """Settings of one worker process (the CLI fills these from its flags)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "float32"
    admin_api_key: str | None = None
    """Bearer key for admin routes (the CLI falls back to ``SGLANG_OMNI_ADMIN_KEY``)."""
    api_key: str | None = None
    """Bearer key for ``/generate`` (the admin key is accepted too)."""
    max_running_requests: int = 32
    log_level: str = "info"
    served_model_name: str | None = None
    health_check_timeout_s: float = 20.0
    num_threads: int | None = None
    """torch intra-op threads (``torch.set_num_threads``); ``None`` keeps torch's default."""
    tp_size: int = 1
    """Tensor-parallel ranks: this process is rank 0 and starts ``tp_size - 1`` followers (one GPU each on CUDA)."""
    step_delay_s: float = 0.0
    """Testing aid: sleep this long after each forward step, to make a tiny
    model behave like a slow one (requests stay in flight long enough to be
    paused, retracted or aborted deterministically)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM: how long generations in flight may run to completion (new ones are refused
    with 503 and ``/health`` says ``draining`` at once) before the rest are aborted. Keep it below
    Kubernetes' ``terminationGracePeriodSeconds`` with room for leaving a weight-update group."""

    allow_pickled_tensors: bool = False
    """Accept SGLang's pickled ``serialized_named_tensors`` (restricted unpickler); the JSON
    handle format is always accepted."""

    snapshot_lease_wait_s: float = 10.0
    """How long a weight update waits for ``/weights_snapshot`` streams in flight before it cuts them."""
    snapshot_send_delay_s: float = 0.0
    """Testing aid: sleep this long after each tensor a ``/weights_snapshot`` stream sends, so a
    transfer stays in flight long enough to be interrupted deterministically."""

    weight_transfer_backend: str = "torch"
    """What vLLM's ``/init_weight_transfer_engine`` builds (``--weight-transfer-config``): ``torch``,
    a ``torch.distributed`` group as SGLang's ``/init_weights_update_group`` builds it (gloo on CPU,
    NCCL on CUDA); or ``nccl``, vLLM's own NCCL engine rendezvous (a ``StatelessProcessGroup``
    store and a bare NCCL communicator, CUDA only), which vLLM's trainer-side engine joins."""

    def public_dict(self) -> dict[str, Any]:
        """The settings without secrets (for ``/server_info``)."""
        data = asdict(self)
        for key in ("admin_api_key", "api_key"):
            data[key] = None
            data[f"{key}_set"] = getattr(self, key) is not None
        return data
