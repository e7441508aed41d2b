"""AReaL's SGLang remote engine (areal 1.0.4) syncing weights through one omni-router URL.

AReaL's own code runs unchanged: its SGLang backend builds every request
(``/init_weights_update_group`` with ``"master_port"`` as a string and ``backend`` from AReaL's
platform, ``/update_weights_from_distributed`` with ``abort_all_requests``, ``/pause_generation``,
``/continue_generation``), its remote-engine helpers send them with its own HTTP client, and its
trainer side joins the group with its own ``init_custom_process_group`` as rank 0 (gloo on CPU,
as AReaL's CPU platform chooses). The broadcast is the one AReaL's FSDP engine runs: one
``torch.distributed.broadcast`` per tensor from rank 0, while the update request is open.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import free_port, http_json
from worker.model import read_checkpoint

sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
remote = pytest.importorskip("areal.infra.remote_inf_engine")
from areal.api.alloc_mode import ModelAllocation, ParallelStrategy  # noqa: E402
from areal.api.cli_args import SchedulingStrategy  # noqa: E402
from areal.api.io_struct import ParamSpec, WeightUpdateMeta  # noqa: E402
from areal.engine.core.distributed import init_custom_process_group  # noqa: E402
from areal.infra.platforms import current_platform  # noqa: E402

TIMEOUT_S = 120.0
GROUP = "update_weight_group"


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # reported by the caller
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _finished(thread: threading.Thread, out: list[Any]) -> Any:
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "AReaL's request never returned"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_distributed_weight_update_through_the_router(fleet: tuple[list[str], str], sync_ckpts: dict[str, str]) -> None:
    workers, router = fleet
    address = router.removeprefix("http://")
    backend = sglang_remote.SGLangBackend()
    port = free_port()
    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation(
            "sglang", "rollout", ParallelStrategy(data_parallel_size=len(workers)), SchedulingStrategy()
        ),
        nccl_master_address="127.0.0.1",
        nccl_master_port=port,
        nccl_group_name=GROUP,
    )
    init = backend.build_init_weights_group_request(address, 0, meta)
    assert isinstance(init.payload["master_port"], str)  # what a strict server refused

    thread, out = _in_thread(remote._init_weights_update_group_remote, backend, meta, [address], TIMEOUT_S)
    group = init_custom_process_group(
        backend=current_platform.communication_backend,
        world_size=len(workers) + 1,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        group_name=GROUP,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    _finished(thread, out)
    try:
        pause = backend.get_pause_request()
        assert http_json(pause.method, router + pause.endpoint, pause.payload)[0] == 200
        named = sorted(read_checkpoint(sync_ckpts["b"], torch.float32))
        for start in range(0, len(named), 8):  # AReaL sends one request per bucket of tensors
            bucket = named[start : start + 8]
            specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1]) for n, t in bucket]
            thread, out = _in_thread(
                remote._update_weights_from_distributed, backend, meta, specs, [address], TIMEOUT_S
            )
            for _, tensor in bucket:
                dist.broadcast(tensor, src=0, group=group)
            _finished(thread, out)
        resume = backend.get_resume_request()
        assert http_json(resume.method, router + resume.endpoint, resume.payload)[0] == 200
    finally:
        dist.destroy_process_group(group)
    expected = hf_greedy(sync_ckpts["b"])
    for url in workers:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 200 and answer["output_ids"] == expected, (url, answer)
