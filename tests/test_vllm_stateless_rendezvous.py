"""The worker's end of vLLM's stateless NCCL rendezvous (:mod:`worker.transfer.vllm.nccl`).

The trainer here is rank 0 of vLLM's ``StatelessProcessGroup`` written with torch's ``TCPStore``
and ``pickle`` only (vLLM is not installed in this suite's environment): a listening socket handed
to a master ``TCPStore`` sized for ``world_size`` ranks, which blocks until every rank has
connected, then ``broadcast_obj`` of the ``ncclUniqueId``: ``pickle.dumps`` of vLLM's ctypes record
under ``broadcast_from/0/0``. The record is pickled from a stand-in class registered under vLLM's
module name, and the bytes are checked against a pickle captured from vLLM 0.31.0. The same tests
against the released vLLM code (its own ``StatelessProcessGroup`` and ``ncclUniqueId``) are in the
client-compatibility tier: ``tests/clients/test_vllm_stateless_rendezvous_client.py``.

Everything is on 127.0.0.1. Real NCCL needs two GPUs (one per rank): those tests are marked
``gpu`` and skip on a machine with fewer.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import pickle
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from router.dataplane.group import GroupError
from tests.procs import free_port
from worker.transfer.vllm.nccl import (
    NCCL_UNIQUE_ID_BYTES,
    RefusedUniqueId,
    RendezvousError,
    decode_unique_id_b64,
    join_vllm_nccl_group,
    receive_unique_id,
    unique_id_from_pickle,
)
from worker.transfer.vllm.nccl.rendezvous import MAX_PICKLE_BYTES, UNIQUE_ID_KEY, VLLM_PYNCCL_MODULE

HOST = "127.0.0.1"
#: Not a speed check: every bound under test here is 0.3 to 2 s; a wait that lasts this long ignored it
#: (the waits it cuts short last 30 s, 60 s, minutes for a store's defaults, or forever).
IGNORED_BOUND_S = 10.0
#: ``pickle.dumps(ncclUniqueId.from_buffer_copy(CAPTURED_ID))`` by vLLM 0.31.0 on Python 3.11.
CAPTURED_ID = bytes((i * 37 + 11) % 256 for i in range(128))
CAPTURED_PICKLE = bytes.fromhex(
    "800495ec000000000000008c075f637479706573948c095f756e7069636b6c659493948c34766c6c6d2e646973747269"
    "62757465642e6465766963655f636f6d6d756e696361746f72732e70796e63636c5f77726170706572948c0c6e63636c"
    "556e6971756549649493947d9443800b30557a9fc4e90e33587da2c7ec11365b80a5caef14395e83a8cdf2173c6186ab"
    "d0f51a3f6489aed3f81d42678cb1d6fb20456a8fb4d9fe23486d92b7dc01264b7095badf04294e7398bde2072c51769b"
    "c0e50a2f54799ec3e80d32577ca1c6eb10355a7fa4c9ee13385d82a7ccf1163b6085aacff4193e6388add2f71c416694"
    "8694869452942e"
)


# -- vLLM's trainer, from torch and pickle -------------------------------------------------------


class NcclUniqueIdStandIn(ctypes.Structure):
    """vLLM's ``pynccl_wrapper.ncclUniqueId``: the same ctypes layout, pickled under vLLM's name."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


@contextlib.contextmanager
def under_name(cls: type, module: str, name: str) -> Iterator[None]:
    """Make ``cls`` resolvable as ``module.name`` (and its parent packages importable) while pickling."""
    parts = module.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    saved = {n: sys.modules.get(n) for n in names}
    saved_names = (cls.__module__, cls.__qualname__)
    missing = object()
    previous: object = missing
    try:
        for n in names:
            if n not in sys.modules:
                sys.modules[n] = types.ModuleType(n)
        previous = getattr(sys.modules[module], name, missing)
        setattr(sys.modules[module], name, cls)
        cls.__module__, cls.__qualname__ = module, name
        yield
    finally:
        cls.__module__, cls.__qualname__ = saved_names
        if saved[module] is not None:
            if previous is missing:
                delattr(saved[module], name)
            else:
                setattr(saved[module], name, previous)
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)


def vllm_pickle(raw: bytes, *, protocol: int | None = None, module: str = VLLM_PYNCCL_MODULE, **attrs: Any) -> bytes:
    """What vLLM's ``broadcast_obj`` stores for an ``ncclUniqueId`` holding ``raw`` (any length here)."""

    class Record(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * len(raw))]

    record = Record.from_buffer_copy(raw)
    for key, value in attrs.items():
        setattr(record, key, value)
    with under_name(Record, module, "ncclUniqueId"):
        return pickle.dumps(record, protocol=protocol)


class StoreTrainer:
    """Rank 0 of vLLM's ``StatelessProcessGroup.create`` + ``broadcast_obj(unique_id, src=0)``."""

    def __init__(self, world_size: int, payload: bytes | None, *, timeout_s: float = 30.0):
        self.port = free_port()
        self.world_size = world_size
        self.payload = payload
        self.timeout_s = timeout_s
        self.all_connected = threading.Event()
        self.error: BaseException | None = None
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-trainer", daemon=True)

    def __enter__(self) -> StoreTrainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._thread.join(self.timeout_s + 10)

    def _run(self) -> None:
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((HOST, self.port))
            listener.listen()
            # Blocks until world_size ranks (this one included) have counted themselves in.
            store = TCPStore(
                host_name=HOST,
                port=self.port,
                world_size=self.world_size,
                is_master=True,
                timeout=timedelta(seconds=self.timeout_s),
                master_listen_fd=listener.detach(),
                use_libuv=False,
            )
            self.all_connected.set()
            if self.payload is not None:
                store.set(UNIQUE_ID_KEY, self.payload)
            self._release.wait(self.timeout_s)
            del store
        except BaseException as exc:
            self.error = exc


def receive(trainer: StoreTrainer, rank: int, timeout_s: float = 20.0, **kw: Any) -> bytes:
    return receive_unique_id(
        master_address=HOST,
        master_port=trainer.port,
        rank=rank,
        world_size=trainer.world_size,
        timeout_s=timeout_s,
        **kw,
    )


# -- the pickle ----------------------------------------------------------------------------------


def test_the_stand_in_pickles_as_vllm_does() -> None:
    assert vllm_pickle(CAPTURED_ID, protocol=4) == CAPTURED_PICKLE
    assert unique_id_from_pickle(CAPTURED_PICKLE) == CAPTURED_ID


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_every_binary_protocol_loads(protocol: int) -> None:
    raw = os.urandom(NCCL_UNIQUE_ID_BYTES)
    assert unique_id_from_pickle(vllm_pickle(raw, protocol=protocol)) == raw


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class _Evaluates:
    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, ("1 + 1",))


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (lambda: pickle.dumps(_Evaluates()), "builtins.eval"),
        (lambda: pickle.dumps(bytes(NCCL_UNIQUE_ID_BYTES)), "not an ncclUniqueId"),
        (
            lambda: vllm_pickle(bytes(128), module="sglang.srt.distributed.device_communicators.pynccl_wrapper"),
            "sglang",
        ),
        (lambda: vllm_pickle(bytes(128), protocol=4, extra=1), "carries no attributes"),
        (lambda: vllm_pickle(bytes(128), protocol=2), "_codecs.encode"),
        (lambda: vllm_pickle(bytes(64)), "128 bytes, this one 64"),
        (lambda: vllm_pickle(bytes(200)), "128 bytes, this one 200"),
        (lambda: b"not a pickle at all", "could not be decoded"),
        (lambda: b"\x80\x04" + b"N" * (MAX_PICKLE_BYTES + 1) + b".", "far smaller"),
    ],
)
def test_anything_but_the_record_is_refused(payload: Any, why: str) -> None:
    with pytest.raises(RefusedUniqueId, match=why):
        unique_id_from_pickle(payload())


def test_a_command_in_the_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(RefusedUniqueId, match=r"(posix|os)\.system"):
        unique_id_from_pickle(pickle.dumps(_RunsCommand(f"touch {marker}")))
    assert not marker.exists()


# -- the store -----------------------------------------------------------------------------------


def test_a_worker_rank_receives_the_id_the_trainer_minted() -> None:
    minted = os.urandom(NCCL_UNIQUE_ID_BYTES)
    with StoreTrainer(2, vllm_pickle(minted)) as trainer:
        assert receive(trainer, 1) == minted
        assert trainer.all_connected.is_set()  # this rank counted itself among the store's world_size
    assert trainer.error is None


def test_two_worker_ranks_both_receive_it() -> None:
    minted = os.urandom(NCCL_UNIQUE_ID_BYTES)
    got: dict[int, bytes | BaseException] = {}

    def run(rank: int) -> None:
        try:
            got[rank] = receive(trainer, rank)
        except BaseException as exc:
            got[rank] = exc

    with StoreTrainer(3, vllm_pickle(minted)) as trainer:
        threads = [threading.Thread(target=run, args=(rank,)) for rank in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert got == {1: minted, 2: minted}
    assert trainer.error is None


def test_a_trainer_that_never_comes_fails_within_the_timeout() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"nothing listens at {HOST}:{port}"):
        receive_unique_id(master_address=HOST, master_port=port, rank=1, world_size=2, timeout_s=1.0)
    assert time.monotonic() - started < IGNORED_BOUND_S  # unbounded, it would wait for a trainer forever


def test_a_trainer_that_never_publishes_fails_within_the_timeout() -> None:
    with StoreTrainer(2, None, timeout_s=10.0) as trainer:
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="did not publish its NCCL unique id"):
            receive(trainer, 1, timeout_s=1.5)
        # It waited out its own bound (no early give-up), and no more (the store's waits default to minutes).
        assert 1.4 < time.monotonic() - started < IGNORED_BOUND_S
        assert trainer.all_connected.is_set()


def test_a_missing_rank_leaves_the_trainer_waiting_and_the_worker_bounded() -> None:
    # world_size 3 with only rank 1 present: the trainer's store waits for rank 2, the worker gives up.
    with StoreTrainer(3, vllm_pickle(bytes(128)), timeout_s=2.5) as trainer:
        with pytest.raises(RendezvousError, match="world_size 3"):
            receive(trainer, 1, timeout_s=1.0)
        assert not trainer.all_connected.is_set()


def test_a_cancel_ends_the_wait() -> None:
    cancel = threading.Event()
    with StoreTrainer(2, None, timeout_s=10.0) as trainer:
        threading.Timer(0.3, cancel.set).start()  # a cancel that comes while the receive waits
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="cancelled"):
            receive(trainer, 1, timeout_s=60.0, cancel=cancel)
        assert time.monotonic() - started < IGNORED_BOUND_S  # not cancelled, it would wait its 60 s


def test_a_malicious_broadcast_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    trainer = StoreTrainer(2, pickle.dumps(_RunsCommand(f"touch {marker}")))
    with trainer, pytest.raises(RefusedUniqueId, match="not admitted"):
        receive(trainer, 1)
    assert not marker.exists()


def test_a_wrong_length_id_in_the_store_is_refused() -> None:
    with StoreTrainer(2, vllm_pickle(bytes(96))) as trainer, pytest.raises(RefusedUniqueId, match="this one 96"):
        receive(trainer, 1)


@pytest.mark.parametrize(("rank", "world_size"), [(0, 2), (2, 2), (-1, 2)])
def test_only_worker_ranks_join(rank: int, world_size: int) -> None:
    with pytest.raises(RendezvousError, match="not a worker rank"):
        receive_unique_id(master_address=HOST, master_port=1, rank=rank, world_size=world_size, timeout_s=1.0)


# -- nccl_unique_id_b64 --------------------------------------------------------------------------

#: An id whose base64 has both ``+`` and ``/``, so its URL-safe spelling has ``-`` and ``_``.
B64_ID = bytes([0xFB, 0xFF, 0xBF] * 42 + [0, 1])


def test_the_b64_id_decodes_to_its_bytes() -> None:
    text = base64.b64encode(B64_ID).decode()
    assert "+" in text and "/" in text
    assert decode_unique_id_b64(master_address=None, master_port=None, nccl_unique_id_b64=text) == B64_ID


def test_the_store_mode_has_no_id() -> None:
    assert decode_unique_id_b64(master_address=HOST, master_port=29500, nccl_unique_id_b64=None) is None
    # vLLM treats an empty id as none.
    assert decode_unique_id_b64(master_address=HOST, master_port=29500, nccl_unique_id_b64="") is None


@pytest.mark.parametrize(
    ("address", "port", "b64", "why"),
    [
        (HOST, 29500, base64.b64encode(B64_ID).decode(), "not both"),
        (None, 29500, base64.b64encode(B64_ID).decode(), "not both"),
        (HOST, None, base64.b64encode(B64_ID).decode(), "not both"),
        (None, None, None, "need nccl_unique_id_b64, or both"),
        (HOST, None, None, "need nccl_unique_id_b64, or both"),
        (None, 29500, "", "need nccl_unique_id_b64, or both"),
        (None, None, base64.urlsafe_b64encode(B64_ID).decode(), "URL-safe base64 is not accepted"),
        (None, None, base64.b64encode(B64_ID).decode().rstrip("="), "not valid standard base64"),
        (None, None, base64.encodebytes(B64_ID).decode(), "not valid standard base64"),
        (None, None, base64.b64encode(bytes(64)).decode(), "must decode to 128 bytes, got 64"),
        (None, None, base64.b64encode(bytes(129)).decode(), "must decode to 128 bytes, got 129"),
    ],
)
def test_vllms_b64_rules(address: str | None, port: int | None, b64: str | None, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_unique_id_b64(master_address=address, master_port=port, nccl_unique_id_b64=b64)


# -- joining without a GPU -----------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_worker_without_cuda_fails_before_the_rendezvous(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with StoreTrainer(2, vllm_pickle(bytes(128)), timeout_s=1.5) as trainer:
        started = time.monotonic()
        with pytest.raises(GroupError, match="needs a CUDA"):
            join_vllm_nccl_group(
                master_address=HOST,
                master_port=trainer.port,
                nccl_unique_id_b64=None,
                rank=1,
                world_size=2,
                device=device,
                timeout_s=30.0,
            )
        assert time.monotonic() - started < IGNORED_BOUND_S  # a join that went ahead would wait its 30 s
    # The trainer's store waited its 1.5 s for rank 1 and gave up (the exit joined its thread): the
    # worker never counted itself in.
    assert not trainer.all_connected.is_set() and trainer.error is not None


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"nccl_unique_id_b64": base64.urlsafe_b64encode(B64_ID).decode()}, "init_info: .*URL-safe"),
        ({"master_address": HOST, "nccl_unique_id_b64": base64.b64encode(B64_ID).decode()}, "init_info: .*not both"),
        ({"rank": 0}, "not a worker rank"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
    ],
)
def test_a_bad_join_is_refused_before_anything(fields: dict[str, Any], why: str) -> None:
    args: dict[str, Any] = {
        "master_address": None,
        "master_port": None,
        "nccl_unique_id_b64": None,
        "rank": 1,
        "world_size": 2,
        "device": "cpu",
        "timeout_s": 5.0,
    }
    with pytest.raises(GroupError, match=why):
        join_vllm_nccl_group(**{**args, **fields})


# -- real NCCL (two GPUs) ------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="real NCCL between a trainer rank and a worker rank needs two GPUs (one rank per GPU)",
)


def _trainer_group(unique_id: bytes, world_size: int, timeout_s: float) -> Any:
    """Trainer rank 0 on cuda:0 with this package's binding: init, vLLM's warm-up, a group to send on."""
    from worker.transfer.vllm.nccl.group import VllmNcclGroup, _placeholder_pg, _warm_up
    from worker.transfer.vllm.nccl.libnccl import Communicator, load_library

    deadline = time.monotonic() + timeout_s
    comm = Communicator.join(
        load_library(), unique_id, rank=0, world_size=world_size, device_index=0, deadline=deadline
    )
    stream = torch.cuda.Stream(device=0)
    _warm_up(comm, torch.device("cuda", 0), stream, deadline, None)
    return VllmNcclGroup(
        name="trainer",
        rank=0,
        world_size=world_size,
        backend="nccl",
        timeout_s=timeout_s,
        pg=_placeholder_pg(0, world_size),
        comm=comm,
        device=torch.device("cuda", 0),
        stream=stream,
    )


def _run_pair(mode: str) -> None:
    from worker.transfer.vllm.nccl.libnccl import load_library

    lib = load_library()
    minted = lib.get_unique_id()
    sent = {
        "bf16": torch.randn(1000, 7, dtype=torch.bfloat16, device="cuda:0"),
        "u8": torch.randint(0, 255, (4099,), dtype=torch.uint8, device="cuda:0"),
    }
    trainer_done: dict[str, Any] = {}
    ready, finish, sent_all = threading.Event(), threading.Event(), threading.Event()

    def trainer() -> None:
        try:
            with StoreTrainer(2, vllm_pickle(minted)) if mode == "store" else contextlib.nullcontext() as store:
                trainer_done["port"] = getattr(store, "port", None)
                ready.set()
                group = _trainer_group(minted, 2, 60.0)
                for tensor in sent.values():
                    group.broadcast(tensor, 60.0)
                torch.cuda.synchronize(0)
                sent_all.set()
                finish.wait(60)  # stays in the group while the worker times out a broadcast never sent
                group.destroy()
        except BaseException as exc:
            trainer_done["error"] = exc
            sent_all.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    assert ready.wait(30)
    group = join_vllm_nccl_group(
        master_address=HOST if mode == "store" else None,
        master_port=trainer_done["port"],
        nccl_unique_id_b64=None if mode == "store" else base64.b64encode(minted).decode(),
        rank=1,
        world_size=2,
        device="cuda:1",
        timeout_s=60.0,
    )
    try:
        for tensor in sent.values():
            got = torch.empty_like(tensor, device="cuda:1")
            group.broadcast(got, 60.0)
            assert torch.equal(got.cpu(), tensor.cpu())
        assert sent_all.wait(60)
        assert "error" not in trainer_done
        # A broadcast the trainer never sends: bounded, and the group is broken and aborted.
        started = time.monotonic()
        with pytest.raises(GroupError, match="did not finish within"):
            group.broadcast(torch.empty(8, device="cuda:1"), 2.0)
        assert time.monotonic() - started < IGNORED_BOUND_S  # unbounded, it would wait for a send that never comes
        assert not group.alive and group.comm is not None and group.comm.aborted
    finally:
        finish.set()
        thread.join(60)
        group.destroy()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("mode", ["store", "b64"])
def test_real_nccl_between_a_trainer_rank_and_a_worker_rank(mode: str) -> None:
    _run_pair(mode)
