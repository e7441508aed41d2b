"""vLLM 0.31's own rendezvous code against the worker's end of it (:mod:`worker.transfer.vllm.nccl`).

The trainer is vLLM's ``StatelessProcessGroup`` (rank 0: its ``TCPStore`` host) broadcasting vLLM's
own ctypes ``ncclUniqueId`` with ``broadcast_obj``, unchanged; ``pynccl_wrapper`` imports without
CUDA, so no stand-in class is needed. On CPU the id is made with ``from_buffer_copy`` instead of
``ncclGetUniqueId``; with two GPUs, vLLM's ``trainer_init`` and ``PyNcclCommunicator`` run the
whole join and broadcast against a worker rank. The same protocol without vLLM installed, written
from torch and pickle, is tested in ``tests/test_vllm_stateless_rendezvous.py``.
"""

from __future__ import annotations

import base64
import os
import pickle
import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from vllm.distributed.device_communicators.pynccl_wrapper import (
    NCCL_UNIQUE_ID_BYTES,
    ncclUniqueId,
)
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer.nccl_common import decode_nccl_unique_id

from tests.procs import free_port
from worker.transfer.vllm.nccl import (
    decode_unique_id_b64,
    join_vllm_nccl_group,
    receive_unique_id,
    unique_id_from_pickle,
)

HOST = "127.0.0.1"
STORE_TIMEOUT_S = 30


class VllmTrainer:
    """Rank 0 of vLLM's ``StatelessProcessGroup``: ``create`` (blocks until every rank connected),
    then ``broadcast_obj(ncclUniqueId, src=0)`` as ``PyNcclCommunicator.__init__`` does."""

    def __init__(self, world_size: int, raw: bytes):
        self.port = free_port()
        self.world_size = world_size
        self.raw = raw
        self.error: BaseException | None = None
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> VllmTrainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._thread.join(STORE_TIMEOUT_S + 10)

    def _run(self) -> None:
        try:
            group = StatelessProcessGroup.create(
                host=HOST, port=self.port, rank=0, world_size=self.world_size, store_timeout=STORE_TIMEOUT_S
            )
            group.broadcast_obj(ncclUniqueId.from_buffer_copy(self.raw), src=0)
            self._release.wait(STORE_TIMEOUT_S)
        except BaseException as exc:
            self.error = exc


def _receive(trainer: VllmTrainer, rank: int) -> bytes:
    return receive_unique_id(
        master_address=HOST, master_port=trainer.port, rank=rank, world_size=trainer.world_size, timeout_s=20.0
    )


@pytest.mark.parametrize("protocol", [None, 3, 4, 5])
def test_vllms_pickled_id_loads(protocol: int | None) -> None:
    raw = os.urandom(NCCL_UNIQUE_ID_BYTES)
    assert unique_id_from_pickle(pickle.dumps(ncclUniqueId.from_buffer_copy(raw), protocol=protocol)) == raw


def test_vllms_trainer_hands_its_id_to_a_worker_rank() -> None:
    minted = os.urandom(NCCL_UNIQUE_ID_BYTES)
    with VllmTrainer(2, minted) as trainer:
        assert _receive(trainer, 1) == minted
    assert trainer.error is None


def test_a_worker_rank_beside_a_vllm_worker_rank() -> None:
    """Rank 1 is this worker, rank 2 vLLM's own ``StatelessProcessGroup`` client: both get the id."""
    minted = os.urandom(NCCL_UNIQUE_ID_BYTES)
    got: dict[str, Any] = {}

    def vllm_rank() -> None:
        try:
            group = StatelessProcessGroup.create(
                host=HOST, port=trainer.port, rank=2, world_size=3, store_timeout=STORE_TIMEOUT_S
            )
            got["vllm"] = bytes(group.broadcast_obj(None, src=0))
        except BaseException as exc:
            got["vllm"] = exc

    with VllmTrainer(3, minted) as trainer:
        thread = threading.Thread(target=vllm_rank)
        thread.start()
        got["ours"] = _receive(trainer, 1)
        thread.join(30)
    assert got == {"ours": minted, "vllm": minted}
    assert trainer.error is None


B64_ID = bytes([0xFB, 0xFF, 0xBF] * 42 + [0, 1])
RENDEZVOUS_CASES: list[tuple[str | None, int | None, str | None]] = [
    (None, None, base64.b64encode(B64_ID).decode()),
    (HOST, 29500, None),
    (HOST, 29500, ""),
    (HOST, 29500, base64.b64encode(B64_ID).decode()),
    (None, 29500, base64.b64encode(B64_ID).decode()),
    (HOST, None, base64.b64encode(B64_ID).decode()),
    (None, None, None),
    (HOST, None, None),
    (None, 29500, ""),
    (None, None, base64.urlsafe_b64encode(B64_ID).decode()),
    (None, None, base64.b64encode(B64_ID).decode().rstrip("=")),
    (None, None, base64.encodebytes(B64_ID).decode()),
    (None, None, " " + base64.b64encode(B64_ID).decode()),
    (None, None, base64.b64encode(bytes(64)).decode()),
    (None, None, base64.b64encode(bytes(129)).decode()),
    (None, None, "é" * 8),
]


@pytest.mark.parametrize(("address", "port", "b64"), RENDEZVOUS_CASES)
def test_the_b64_rules_are_vllms(address: str | None, port: int | None, b64: str | None) -> None:
    def outcome(decode: Any, **kw: Any) -> bytes | str | None:
        try:
            return decode(master_address=address, master_port=port, nccl_unique_id_b64=b64, **kw)
        except ValueError:
            return "refused"

    assert outcome(decode_unique_id_b64) == outcome(decode_nccl_unique_id, ctx="init_info")


# -- vLLM's communicator against a worker rank (two GPUs) ----------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="real NCCL between vLLM's trainer rank and a worker rank needs two GPUs (one rank per GPU)",
)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("mode", ["store", "b64"])
def test_vllms_communicator_broadcasts_to_a_worker_rank(mode: str) -> None:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    port = free_port()
    minted = bytes(NCCLLibrary().ncclGetUniqueId())
    sent = [
        torch.randn(1000, 7, dtype=torch.bfloat16, device="cuda:0"),
        torch.randint(0, 255, (4099,), dtype=torch.uint8, device="cuda:0"),
    ]
    state: dict[str, Any] = {}
    finish = threading.Event()

    def trainer() -> None:
        try:
            torch.cuda.set_device(0)
            if mode == "store":
                comm = trainer_init({"master_address": HOST, "master_port": port, "world_size": 2})
            else:
                comm = PyNcclCommunicator.from_unique_id_bytes(minted, rank=0, world_size=2, device=0)
            for tensor in sent:
                comm.broadcast(tensor, src=0)
            torch.cuda.current_stream().synchronize()
            state["sent"] = True
            finish.wait(60)
            comm.destroy()
        except BaseException as exc:
            state["error"] = exc

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    group = join_vllm_nccl_group(
        master_address=HOST if mode == "store" else None,
        master_port=port if mode == "store" else None,
        nccl_unique_id_b64=None if mode == "store" else base64.b64encode(minted).decode(),
        rank=1,
        world_size=2,
        device="cuda:1",
        timeout_s=60.0,
    )
    try:
        for tensor in sent:
            got = torch.empty_like(tensor, device="cuda:1")
            group.broadcast(got, 60.0)
            assert torch.equal(got.cpu(), tensor.cpu())
        started = time.monotonic()
        with pytest.raises(Exception, match="did not finish within"):
            group.broadcast(torch.empty(8, device="cuda:1"), 2.0)
        assert time.monotonic() - started < 10.0
        assert not group.alive
    finally:
        finish.set()
        thread.join(60)
        group.destroy()
    assert state.get("sent") and "error" not in state
