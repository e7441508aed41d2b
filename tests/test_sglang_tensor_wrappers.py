"""SGLang's ``LocalSerializedTensor`` and patched CUDA rebuild through the restricted unpickler.

verl 0.9.1's SGLang adapter calls SGLang 0.5.23's ``update_weights`` helper, which posts
``/update_weights_from_tensor`` with ``{"serialized_named_tensors": [one base64 pickle per
TP rank], "load_format": null, "flush_cache": true}``; each pickle is a list of ``(name,
LocalSerializedTensor(values=[one ForkingPickler pickle per TP rank]))`` pairs, and on a GPU
each inner pickle names ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`` with
the device as a GPU UUID.

sglang is not installed in this environment (the real-client tier runs it), so the payloads
here are built WITHOUT importing it: :class:`LocalSerializedTensor`, :class:`OldPathLocalSerializedTensor`
and :func:`_rebuild_cuda_tensor_modified` below are STAND-INS, registered in throwaway
``sys.modules`` entries under SGLang's module paths so that ``pickle`` writes exactly the
global names SGLang's objects get. Nothing of SGLang's is imported or copied.
"""

from __future__ import annotations

import base64
import io
import multiprocessing
import os
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions

from router.trainer.sender import sent_checksum
from worker.model.checkpoint import read_checkpoint
from worker.transfer.handles import safe_unpickle, sglang_wrappers
from worker.transfer.handles.pickle_records import CudaTensor, SharedTensor, UnsafePayload

PATH = "/update_weights_from_tensor"
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
OLD_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
PATCH_TORCH = "sglang.srt.utils.patch_torch"
UUID_A = "6c1d8f0e-2b7a-4c39-9e51-0d7f3a2b9c10"
UUID_B = "f3a9b2c4-7e1d-4a6b-8c2f-5d9e0a1b3c47"


@dataclass
class LocalSerializedTensor:
    """STAND-IN, not SGLang's class: a dataclass with SGLang's one field, registered as
    ``sglang.srt.model_executor.model_runner_components.weight_updater.LocalSerializedTensor``."""

    values: Any


LocalSerializedTensor.__module__ = WEIGHT_UPDATER


@dataclass
class OldPathLocalSerializedTensor:
    """STAND-IN for the same class under its pre-0.5.16 path
    ``sglang.srt.model_executor.model_runner.LocalSerializedTensor``."""

    values: Any


OldPathLocalSerializedTensor.__module__ = OLD_MODEL_RUNNER
OldPathLocalSerializedTensor.__name__ = OldPathLocalSerializedTensor.__qualname__ = "LocalSerializedTensor"


def _rebuild_cuda_tensor_modified(*args: Any) -> Any:
    """STAND-IN for ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``: only its
    global name is pickled; the worker must never call it."""
    raise AssertionError("the stand-in rebuild must never be called")


_rebuild_cuda_tensor_modified.__module__ = PATCH_TORCH


def _standin_modules() -> dict[str, types.ModuleType]:
    modules: dict[str, types.ModuleType] = {}
    for dotted in (WEIGHT_UPDATER, OLD_MODEL_RUNNER, PATCH_TORCH):
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            modules.setdefault(name, types.ModuleType(name))
    modules[WEIGHT_UPDATER].LocalSerializedTensor = LocalSerializedTensor  # type: ignore[attr-defined]
    modules[OLD_MODEL_RUNNER].LocalSerializedTensor = OldPathLocalSerializedTensor  # type: ignore[attr-defined]
    modules[PATCH_TORCH]._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified  # type: ignore[attr-defined]
    return modules


@pytest.fixture(autouse=True)
def sglang_standins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, module in _standin_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


class _Reduced:
    """Pickles as ``fn(*args)``: how a reducer's ``(fn, args)`` pair appears in the stream."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def serialize(obj: Any) -> bytes:
    """As SGLang's ``MultiprocessingSerializer.serialize``: ``ForkingPickler``, default protocol, raw bytes
    (CPU storages under the ``file_system`` sharing strategy)."""
    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def wrapped(named: list[tuple[str, Any]], tp_size: int = 1, cls: type = LocalSerializedTensor) -> bytes:
    """One rank's ``serialized_named_tensors`` entry as SGLang's ``update_weights`` helper builds
    it: every tensor wrapped with one inner pickle per TP rank (here each rank's copy is the same tensor)."""
    return serialize([(name, cls(values=[serialize(t) for _ in range(tp_size)])) for name, t in named])


def verl_body(named: list[tuple[str, torch.Tensor]], tp_size: int = 1) -> dict[str, Any]:
    """The JSON body verl's HTTP adapter posts for one bucket (``load_format`` None, ``flush_cache`` True)."""
    entries = [base64.b64encode(wrapped(named, tp_size)).decode() for _ in range(tp_size)]
    return {"serialized_named_tensors": entries, "load_format": None, "flush_cache": True}


def _records(raw: bytes, tp_rank: int = 0, tp_size: int = 1) -> list[tuple[str, Any]]:
    return safe_unpickle.named_lazy_tensors(safe_unpickle.load_raw(raw), None, tp_rank=tp_rank, tp_size=tp_size)


def _cuda_args(shape: tuple[int, ...], device: Any, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s 15 arguments for a tensor that exists nowhere (its handles are made up)."""
    numel = 1
    for d in shape:
        numel *= d
    stride = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
    nbytes = numel * dtype.itemsize
    return (torch.Tensor, torch.Size(shape), stride, 0, torch.storage.TypedStorage, dtype, device,
            b"\x01" * 64, nbytes, 0, False, b"ref", 0, b"\x02" * 64, True)  # fmt: skip


def _cuda_wrapped(name: str, shape: tuple[int, ...], device: Any) -> bytes:
    inner = serialize(_Reduced(_rebuild_cuda_tensor_modified, _cuda_args(shape, device)))
    return serialize([(name, LocalSerializedTensor(values=[inner]))])


# -- the unpickler -------------------------------------------------------------------------


def test_tp1_takes_values0_and_the_old_module_path() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for cls in (LocalSerializedTensor, OldPathLocalSerializedTensor):
        [(name, record)] = _records(wrapped([("w", t)], cls=cls))
        assert name == "w" and isinstance(record, SharedTensor)
        assert torch.equal(safe_unpickle.materialize(record), t)


def test_tp2_each_rank_loads_only_its_own_pickle(tmp_path: Path) -> None:
    t0, t1 = torch.zeros(2, 3), torch.arange(6, dtype=torch.float32).reshape(2, 3)
    raw = serialize([("w", LocalSerializedTensor(values=[serialize(t0), serialize(t1)]))])
    [(_, rank1)] = _records(raw, tp_rank=1, tp_size=2)
    assert torch.equal(safe_unpickle.materialize(rank1), t1)
    [(_, rank0)] = _records(raw, tp_rank=0, tp_size=2)
    assert torch.equal(safe_unpickle.materialize(rank0), t0)
    # Another rank's pickle is never loaded, so even a malicious one there runs nothing.
    marker = tmp_path / "pwned"
    raw = serialize([("w", LocalSerializedTensor(values=[pickle.dumps(_Evil(marker)), serialize(t1)]))])
    [(_, rank1)] = _records(raw, tp_rank=1, tp_size=2)
    assert torch.equal(safe_unpickle.materialize(rank1), t1)
    assert not marker.exists()


def test_base64_str_values_are_accepted_as_sglang_does() -> None:
    t = torch.ones(4)
    raw = serialize([("w", LocalSerializedTensor(values=[base64.b64encode(serialize(t)).decode()]))])
    [(_, record)] = _records(raw)
    assert torch.equal(safe_unpickle.materialize(record), t)
    bad = serialize([("w", LocalSerializedTensor(values=["not base64!"]))])
    with pytest.raises(UnsafePayload, match="base64"):
        _records(bad)


def test_inner_pickle_naming_os_system_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for proto in (2, 4, 5):
        raw = serialize([("w", LocalSerializedTensor(values=[pickle.dumps(_Evil(marker), protocol=proto)]))])
        with pytest.raises(UnsafePayload, match=r"posix\.system.*allowlist"):
            _records(raw)
    assert not marker.exists()


def _refused(raw: bytes, match: str, tp_size: int = 1) -> None:
    with pytest.raises(UnsafePayload, match=match):
        _records(raw, tp_size=tp_size)


def test_wrong_types_and_lengths_are_refused() -> None:
    inner = serialize(torch.ones(2))
    _refused(serialize([("w", LocalSerializedTensor(values=[inner, inner]))]), "holds 2 per-rank pickles.*tp_size 1")
    _refused(serialize([("w", LocalSerializedTensor(values=[inner]))]), "holds 1 per-rank pickles.*tp_size 2", 2)
    _refused(serialize([("w", LocalSerializedTensor(values=[]))]), "holds 0 per-rank pickles")
    _refused(serialize([("w", LocalSerializedTensor(values=(inner,)))]), "must be a list of pickles")
    _refused(serialize([("w", LocalSerializedTensor(values=[7]))]), "must be a list of pickles")
    _refused(serialize([("w", LocalSerializedTensor(values=inner))]), "must be a list of pickles")
    extra = LocalSerializedTensor(values=[inner])
    extra.device = "cuda"  # type: ignore[attr-defined]
    _refused(serialize([("w", extra)]), r"exactly \{'values'")
    # Called with arguments (REDUCE) instead of stored as an instance.
    _refused(serialize([("w", _Reduced(LocalSerializedTensor, ([inner],)))]), "no arguments")
    # The inner pickle must be a tensor.
    _refused(serialize([("w", LocalSerializedTensor(values=[serialize([1, 2])]))]), "pickled shared tensors")
    _refused(serialize([("w", LocalSerializedTensor(values=[b"garbage"]))]), "could not be decoded")
    # Only as the tensor of a (name, tensor) pair.
    _refused(serialize(LocalSerializedTensor(values=[inner])), r"list of \(name, tensor\) pairs")
    flat = {"flattened_tensor": LocalSerializedTensor(values=[inner]), "metadata": []}
    with pytest.raises(UnsafePayload, match="1-D uint8 shared tensor"):
        safe_unpickle.flattened_entries(safe_unpickle.load_raw(serialize(flat)))
    with pytest.raises(ValueError, match="outside tp_size"):
        sglang_wrappers.rank_payload(sglang_wrappers.LocalSerializedRecord(), 2, 2)


def test_nesting_is_bounded_to_one_level() -> None:
    inner = serialize(torch.ones(2))
    nested = serialize(LocalSerializedTensor(values=[inner]))
    _refused(serialize([("w", LocalSerializedTensor(values=[nested]))]), "nested more than 1 level")
    deeper = serialize(LocalSerializedTensor(values=[nested]))
    _refused(serialize([("w", LocalSerializedTensor(values=[deeper]))]), "nested more than 1 level")


def test_other_sglang_names_stay_refused() -> None:
    npu = types.FunctionType(_rebuild_cuda_tensor_modified.__code__, {}, "_rebuild_npu_tensor_modified")
    npu.__module__, npu.__qualname__ = PATCH_TORCH, "_rebuild_npu_tensor_modified"
    sys.modules[PATCH_TORCH]._rebuild_npu_tensor_modified = npu  # type: ignore[attr-defined]
    _refused(serialize([("w", _Reduced(npu, (1,)))]), "_rebuild_npu_tensor_modified.*allowlist")
    # LocalSerializedTensor under any other module is not admitted.
    sys.modules[PATCH_TORCH].LocalSerializedTensor = LocalSerializedTensor  # type: ignore[attr-defined]
    LocalSerializedTensor.__module__ = PATCH_TORCH
    try:
        _refused(serialize([("w", LocalSerializedTensor(values=[serialize(torch.ones(1))]))]), "allowlist")
    finally:
        LocalSerializedTensor.__module__ = WEIGHT_UPDATER


# -- CUDA records and GPU UUIDs ------------------------------------------------------------


def test_patched_cuda_rebuild_is_a_record_with_the_uuid() -> None:
    [(name, record)] = _records(_cuda_wrapped("w", (3, 4), UUID_B))
    assert name == "w" and isinstance(record, CudaTensor)
    assert record.device == UUID_B and record.shape == (3, 4) and record.dtype == torch.float32
    # The unmapped record opens nothing.
    with pytest.raises(UnsafePayload, match="mapped to a local index"):
        safe_unpickle.materialize(record)
    for device in (True, -1, "", "x" * 65, 1.5):
        _refused(_cuda_wrapped("w", (3, 4), device), "index or a GPU UUID")


def test_uuid_maps_to_the_local_index_and_unknown_is_refused() -> None:
    [(_, record)] = _records(_cuda_wrapped("w", (3, 4), UUID_B))
    [mapped] = sglang_wrappers.on_local_devices([record], uuids=[UUID_A, UUID_B])
    assert isinstance(mapped, CudaTensor) and mapped.device == 1
    assert mapped.args[:6] == record.args[:6] and mapped.args[7:] == record.args[7:]
    with pytest.raises(UnsafePayload, match=f"GPU '{UUID_B}', which is not on this host.*sees 1 CUDA device"):
        sglang_wrappers.on_local_devices([record], uuids=[UUID_A])
    with pytest.raises(UnsafePayload, match=r"not on this host.*sees no CUDA device"):
        sglang_wrappers.on_local_devices([record], uuids=[])
    assert sglang_wrappers.device_index(0, [UUID_A]) == 0
    with pytest.raises(UnsafePayload, match="CUDA device 1, which this worker sees 1"):
        sglang_wrappers.device_index(1, [UUID_A])
    # CPU records pass through, and the host's table is not even read for them.
    cpu = SharedTensor(storage=None, offset=0, shape=(1,), stride=(1,))  # type: ignore[arg-type]
    assert sglang_wrappers.on_local_devices([cpu], uuids=None) == [cpu]


def test_local_device_table_is_read_as_sglang_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Props:
        def __init__(self, uuid: str) -> None:
            self.uuid = uuid

    table = [UUID_A, UUID_B]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(table))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(table[i]))
    assert sglang_wrappers.local_device_uuids() == table
    [(_, record)] = _records(_cuda_wrapped("w", (2,), UUID_B))
    [mapped] = sglang_wrappers.on_local_devices([record])
    assert isinstance(mapped, CudaTensor) and mapped.device == 1


# -- a real worker process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(worker_factory, checkpoints):
    return {
        "plain": worker_factory(checkpoints["llama"]),
        "pickles": worker_factory(checkpoints["llama"], "--allow-pickled-tensors"),
    }


def test_worker_loads_a_verl_body(workers, checkpoints, tmp_path: Path) -> None:
    w = workers["pickles"]
    named = [(n, t.clone()) for n, t in read_checkpoint(checkpoints["llama_b"], torch.float32)]
    expected = sent_checksum(named)
    assert w.checksum() != expected
    half = len(named) // 2
    for bucket in (named[:half], named[half:]):  # verl posts one request per bucket
        answer = w.ok("POST", PATH, verl_body(bucket))
        assert answer["success"] is True, answer
    assert w.checksum() == expected
    w.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})

    workers["plain"].refused(PATH, verl_body(named), "--allow-pickled-tensors")
    body = {**verl_body(named), "serialized_named_tensors": [base64.b64encode(wrapped(named, tp_size=2)).decode()]}
    w.refused(PATH, body, "holds 2 per-rank pickles", "tp_size 1")
    marker = tmp_path / "pwned"
    evil = serialize([(named[0][0], LocalSerializedTensor(values=[pickle.dumps(_Evil(marker))]))])
    w.refused(PATH, {"serialized_named_tensors": [base64.b64encode(evil).decode()]}, "posix.system")
    assert not marker.exists()
    # A CUDA IPC tensor named by a GPU this host does not have is refused before anything opens.
    name, t = named[0]
    cuda = base64.b64encode(_cuda_wrapped(name, tuple(t.shape), UUID_A)).decode()
    w.refused(PATH, {"serialized_named_tensors": [cuda]}, UUID_A, "not on this host")


def test_a_tp2_worker_loads_a_verl_body_for_two_ranks(worker_factory, checkpoints) -> None:
    tp2 = worker_factory(checkpoints["llama"], "--tp-size", "2", "--allow-pickled-tensors", "--num-threads", "1")
    named = [(n, t.clone()) for n, t in read_checkpoint(checkpoints["llama_b"], torch.float32)]
    one_entry = {
        **verl_body(named, tp_size=2),
        "serialized_named_tensors": verl_body(named, 2)["serialized_named_tensors"][:1],
    }
    tp2.refused(PATH, one_entry, "1 entries", "tp_size 2")
    one_value = base64.b64encode(wrapped(named, tp_size=1)).decode()
    tp2.refused(PATH, {"serialized_named_tensors": [one_value, one_value]}, "holds 1 per-rank pickles")
    answer = tp2.ok("POST", PATH, verl_body(named, tp_size=2))
    assert [r["success"] for r in answer["rank_results"]] == [True, True], answer
    ranks = tp2.ok("POST", "/weights_checker", {"action": "checksum"})["ranks"]
    assert [r["full_checksum"] for r in ranks] == [sent_checksum(named)] * 2  # both ranks hold the new weights


# -- real CUDA (needs a GPU) ---------------------------------------------------------------


def _cuda_producer(conn: Connection) -> None:
    """A trainer rank: serializes a CUDA tensor as SGLang's patched reductions do (torch's own CUDA
    reduction, then the device index replaced by the GPU's UUID), and keeps it alive until told."""
    sys.modules.update(_standin_modules())
    t = torch.arange(12, dtype=torch.float32, device="cuda:0").reshape(3, 4)
    _fn, args = reductions.reduce_tensor(t)
    uuid_args = list(args)
    uuid_args[6] = str(torch.cuda.get_device_properties(args[6]).uuid)
    inner = serialize(_Reduced(_rebuild_cuda_tensor_modified, tuple(uuid_args)))
    conn.send(serialize([("w", LocalSerializedTensor(values=[inner]))]))
    conn.recv()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_payload_with_a_uuid_opens_on_the_local_gpu() -> None:  # pragma: no cover - needs a GPU
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=_cuda_producer, args=(child,))
    producer.start()
    try:
        raw = parent.recv()
        [(_, record)] = _records(raw)
        assert isinstance(record, CudaTensor) and isinstance(record.device, str)
        [local] = sglang_wrappers.on_local_devices([record])
        got = safe_unpickle.materialize(local)
        assert got.is_cuda and torch.equal(got.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    finally:
        parent.send("done")
        producer.join(timeout=60)
    assert producer.exitcode == 0
