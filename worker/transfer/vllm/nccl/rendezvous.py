"""The worker's end of vLLM's stateless rendezvous: how a vLLM trainer hands out its NCCL unique id.

vLLM's trainer (``NCCLTrainerWeightTransferEngine``, ``nccl_common.trainer_init``) is rank 0 of a
``StatelessProcessGroup``: it hosts a c10d ``TCPStore`` at ``master_address:master_port``, sized for
``world_size`` clients and blocking until all of them have connected, then mints an
``ncclUniqueId`` and publishes it with ``broadcast_obj``: the pickled object under the key
``broadcast_from/<src>/<n>`` (``src`` 0, ``n`` the how-many-th broadcast of that source, 0 for the
id). Every other rank connects as a store client, reads the same key and loads the pickle.

Here a worker rank does that and nothing else:

* it connects as a client that counts itself among the store's ``world_size`` (the trainer's
  store otherwise waits for it until its own timeout), after waiting for the listener itself so
  that a trainer that never comes fails within ``timeout_s`` and not within torch's retries;
* it polls for the key, so that every wait is bounded by one deadline and can be cancelled;
* it never runs ``pickle.loads`` on the trainer's bytes: :func:`unique_id_from_pickle` admits
  exactly the reconstruction of a ctypes record of vLLM's class
  (``_ctypes._unpickle(ncclUniqueId, ({}, <128 bytes>))``, as ``pickle.dumps`` writes it for
  protocols 3 to 5; vLLM uses the default) and returns the 128 raw bytes; any other global, a record of another length,
  or a payload over :data:`MAX_PICKLE_BYTES` is refused before anything is called;
* it drops its store connection as soon as it has the id (vLLM's trainer does not use the store
  after the broadcast).

vLLM's other rendezvous, ``nccl_unique_id_b64`` (the id minted out of band, no store), is decoded
by :func:`decode_unique_id_b64` with vLLM's rules (``nccl_common.decode_nccl_unique_id``).
"""

from __future__ import annotations

import io
import pickle
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from router.contract.vllm import NCCL_UNIQUE_ID_BYTES
from router.dataplane.group import GroupError

#: ``sizeof(ncclUniqueId)``: NCCL's id is 128 opaque bytes.
#: Where vLLM defines its ctypes ``ncclUniqueId`` (the module a pickle of it names).
VLLM_PYNCCL_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
VLLM_UNIQUE_ID_CLASS = "ncclUniqueId"
#: The trainer's rank in vLLM's group: the store's host and the source of the id.
TRAINER_RANK = 0
#: A pickled id is about 250 bytes; a larger value in the key is refused unread.
MAX_PICKLE_BYTES = 4096
#: How often the key and the listener are looked for while waiting.
POLL_S = 0.05


class RendezvousError(GroupError):
    """The trainer's id did not arrive within the deadline, or arrived unusable."""


class RefusedUniqueId(RendezvousError):
    """The value under the broadcast key is not a pickled vLLM ``ncclUniqueId`` (the message says why)."""


def broadcast_key(src: int, count: int) -> str:
    """The store key of the ``count``-th ``broadcast_obj`` of rank ``src`` (vLLM's ``StatelessProcessGroup``)."""
    return f"broadcast_from/{src}/{count}"


#: The id is the trainer's first broadcast.
UNIQUE_ID_KEY = broadcast_key(TRAINER_RANK, 0)


# -- nccl_unique_id_b64 --------------------------------------------------------------------------


# -- the restricted unpickler --------------------------------------------------------------------


class _UniqueIdClass:
    """Stands for vLLM's ctypes ``ncclUniqueId`` class while loading: only ever an argument of
    :func:`_ctypes_unpickle`; creating one (``REDUCE``, ``NEWOBJ``) is refused."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _UniqueIdClass:
        raise RefusedUniqueId(f"{VLLM_UNIQUE_ID_CLASS} may only be rebuilt as a ctypes record")


class _UniqueIdRecord:
    """What a pickled ``ncclUniqueId`` loads as: its raw bytes, nothing callable."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __setstate__(self, state: Any) -> None:
        raise RefusedUniqueId("the ncclUniqueId record takes no further state")


def _ctypes_unpickle(kind: Any, state: Any) -> _UniqueIdRecord:
    """``_ctypes._unpickle(cls, (instance_dict, raw_bytes))`` for vLLM's class only."""
    if kind is not _UniqueIdClass:
        raise RefusedUniqueId("_ctypes._unpickle is admitted only for vLLM's ncclUniqueId")
    if not (isinstance(state, tuple) and len(state) == 2):
        raise RefusedUniqueId("a ctypes record's state must be (dict, bytes)")
    attributes, raw = state
    if not isinstance(attributes, dict) or attributes:
        raise RefusedUniqueId("an ncclUniqueId record carries no attributes")
    if not isinstance(raw, bytes):
        raise RefusedUniqueId("an ncclUniqueId record's state must be bytes")
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise RefusedUniqueId(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, this one {len(raw)}")
    return _UniqueIdRecord(raw)


_ADMITTED: dict[tuple[str, str], Any] = {
    ("_ctypes", "_unpickle"): _ctypes_unpickle,
    (VLLM_PYNCCL_MODULE, VLLM_UNIQUE_ID_CLASS): _UniqueIdClass,
}


class _UniqueIdUnpickler(pickle.Unpickler):
    """Resolves only the two globals of a pickled ctypes ``ncclUniqueId``."""

    def find_class(self, module: str, name: str) -> Any:
        admitted = _ADMITTED.get((module, name))
        if admitted is None:
            raise RefusedUniqueId(f"the broadcast object references {module}.{name}, which is not admitted")
        return admitted

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedUniqueId("persistent ids are not admitted")


def unique_id_from_pickle(raw: bytes) -> bytes:
    """The 128 bytes of a pickled vLLM ``ncclUniqueId``; :class:`RefusedUniqueId` for anything else."""
    if len(raw) > MAX_PICKLE_BYTES:
        raise RefusedUniqueId(f"the broadcast object is {len(raw)} bytes; a pickled ncclUniqueId is far smaller")
    try:
        loaded = _UniqueIdUnpickler(io.BytesIO(raw)).load()
    except RefusedUniqueId:
        raise
    except Exception as exc:  # a malformed stream: whatever pickle raised, it is the trainer's
        raise RefusedUniqueId(f"the broadcast object could not be decoded: {type(exc).__name__}: {exc}") from None
    if not isinstance(loaded, _UniqueIdRecord):
        raise RefusedUniqueId(f"the broadcast object is a {type(loaded).__name__}, not an ncclUniqueId")
    return loaded.raw


# -- the store -----------------------------------------------------------------------------------


def receive_unique_id(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    cancel: threading.Event | None = None,
) -> bytes:
    """Join the trainer's store as ``rank`` and return the id it broadcast (blocks; call from a thread).

    Every wait ends by ``timeout_s`` from the call, or as soon as ``cancel`` is set, with
    :class:`RendezvousError`; the store connection is closed on every return."""
    if not 0 < rank < world_size:
        raise RendezvousError(f"rank {rank} is not a worker rank of world_size {world_size} (the trainer is rank 0)")
    if timeout_s <= 0:
        raise RendezvousError(f"timeout_s must be positive, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    where = f"{master_address}:{master_port}"
    _wait_for_listener(master_address, master_port, deadline, cancel, timeout_s)
    store: TCPStore | None = None
    try:
        try:
            # Counted among the store's world_size, as vLLM's ranks are: its host waits for all of them.
            store = TCPStore(
                host_name=master_address,
                port=master_port,
                world_size=world_size,
                is_master=False,
                timeout=_left(deadline),
                wait_for_workers=True,
            )
        except Exception as exc:
            raise RendezvousError(f"could not join the trainer's store at {where}: {_short(exc)}") from None
        while True:
            _check_cancel(cancel)
            try:
                if store.check([UNIQUE_ID_KEY]):
                    store.set_timeout(_left(deadline))
                    raw = store.get(UNIQUE_ID_KEY)
                    break
            except Exception as exc:
                raise RendezvousError(f"the trainer's store at {where} failed: {_short(exc)}") from None
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"the trainer at {where} did not publish its NCCL unique id ({UNIQUE_ID_KEY!r}) within "
                    f"{timeout_s:g}s (do the trainer and every worker rank agree on world_size {world_size}?)"
                )
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
    finally:
        del store  # closes the client connection
    return unique_id_from_pickle(raw)


def _wait_for_listener(
    address: str, port: int, deadline: float, cancel: threading.Event | None, timeout_s: float
) -> None:
    """Wait for the trainer's listener ourselves: torch's client retries past its timeout."""
    while True:
        _check_cancel(cancel)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousError(
                f"nothing listens at {address}:{port} after {timeout_s:g}s (is the trainer's rank 0 up?)"
            )
        try:
            with socket.create_connection((address, port), timeout=min(1.0, remaining)):
                return
        except OSError:
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise RendezvousError("joining the trainer's group was cancelled")


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _short(exc: BaseException, limit: int = 300) -> str:
    """One line of an exception's text (torch appends C++ backtraces)."""
    text = " ".join(str(exc).split("Exception raised from", 1)[0].split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
