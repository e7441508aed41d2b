"""A minimal ctypes binding to NCCL for vLLM's NCCL weight-transfer group: the calls a receiving
rank makes, and nothing that needs a compiler.

vLLM's ranks (``PyNcclCommunicator``) join with ``ncclCommInitRank`` from the shared 128-byte id,
then run a one-element float32 sum ``ncclAllReduce`` as a warm-up before any other collective,
then move weights with ``ncclBroadcast`` from rank 0. This module does the same with one
difference that does not show on the wire: the communicator is created **non-blocking**
(``ncclCommInitRankConfig`` with ``blocking = 0``), so that no call can wait past a deadline. An
init or a collective that returns ``ncclInProgress`` is polled with ``ncclCommGetAsyncError`` until
it settles; a deadline that passes, a cancel, or an asynchronous error (a peer gone) ends in
``ncclCommAbort``, run on a daemon thread and waited for a bounded time, as vLLM's ``destroy`` does.

The library is the ``libnccl.so.2`` of torch's CUDA wheels (the ``nvidia-nccl-cu*`` package, or
the one torch already loaded), found and loaded on first use only; on a machine without CUDA
:func:`load_library` raises :class:`NcclError` at once.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from router.dataplane.group import GroupError

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_SUM = 0
NCCL_UINT8 = 1
NCCL_FLOAT32 = 7
UNIQUE_ID_BYTES = 128
#: ``ncclConfig_t`` as NCCL 2.14 introduced it. NCCL copies a config no further than its ``size``
#: and ignores fields newer than its ``version``, so every later field keeps its default.
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # NCCL_VERSION(2, 14, 0)
#: NCCL's data types for torch's, as vLLM's sender maps them; any other dtype crosses as its bytes
#: (NCCL runs every broadcast as a byte copy, so only the byte count has to agree).
_NCCL_TYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: NCCL_UINT8,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: NCCL_FLOAT32,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.float8_e4m3fn: 10,
}
#: How long an abort may take before the caller moves on (it finishes on its daemon thread).
ABORT_WAIT_S = 5.0
_WHEEL_LIBRARY = os.path.join("lib", "libnccl.so.2")
_SONAME = "libnccl.so.2"


class NcclError(GroupError):
    """NCCL is unavailable here, or a call failed, timed out or was cancelled."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]


_Comm = ctypes.c_void_p
_Ptr = ctypes.c_void_p
#: name → (restype, argtypes) of every function used.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRankConfig": (
        ctypes.c_int,
        [ctypes.POINTER(_Comm), ctypes.c_int, UniqueId, ctypes.c_int, ctypes.POINTER(_Config)],
    ),
    "ncclCommGetAsyncError": (ctypes.c_int, [_Comm, ctypes.POINTER(ctypes.c_int)]),
    "ncclAllReduce": (
        ctypes.c_int,
        [_Ptr, _Ptr, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Ptr],
    ),
    "ncclBroadcast": (
        ctypes.c_int,
        [_Ptr, _Ptr, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Ptr],
    ),
    "ncclCommAbort": (ctypes.c_int, [_Comm]),
}


class NcclLibrary:
    """The loaded ``libnccl`` with typed entry points."""

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as exc:
            raise NcclError(f"could not load NCCL from {path!r}: {exc}") from None
        self.path = path
        self.fn: dict[str, Callable[..., Any]] = {}
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise NcclError(f"{path} has no {name} (NCCL 2.14 or later is needed)") from None
            fn.restype, fn.argtypes = restype, argtypes
            self.fn[name] = fn
        raw = ctypes.c_int()
        self.check(self.fn["ncclGetVersion"](ctypes.byref(raw)), "ncclGetVersion")
        self.version_code = raw.value
        if self.version_code < _CONFIG_VERSION:
            raise NcclError(f"{path} is NCCL {self.version}; non-blocking communicators need 2.14 or later")

    @property
    def version(self) -> str:
        code = self.version_code
        major, rest = divmod(code, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"

    def error_text(self, result: int) -> str:
        text = self.fn["ncclGetErrorString"](result)
        return text.decode(errors="replace") if text else f"NCCL error {result}"

    def check(self, result: int, what: str) -> None:
        if result != NCCL_SUCCESS:
            raise NcclError(f"{what} failed: {self.error_text(result)} ({result})")

    def get_unique_id(self) -> bytes:
        """A fresh id (what a trainer's rank 0 mints)."""
        uid = UniqueId()
        self.check(self.fn["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid)


_LOADED: dict[str, NcclLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load_library(path: str | None = None) -> NcclLibrary:
    """NCCL, loaded once per path: ``path`` if given, else the ``nvidia-nccl`` wheel's library,
    else whichever ``libnccl.so.2`` the loader finds (torch's CUDA build has already loaded one)."""
    if not torch.cuda.is_available():
        raise NcclError(
            "vLLM's NCCL weight-transfer engine needs a CUDA device; this process has none "
            "(torch.cuda.is_available() is False)"
        )
    candidates = [path] if path else [*_wheel_library(), _SONAME]
    errors = []
    with _LOAD_LOCK:
        for candidate in candidates:
            if candidate in _LOADED:
                return _LOADED[candidate]
            try:
                lib = _LOADED[candidate] = NcclLibrary(candidate)
                return lib
            except NcclError as exc:
                errors.append(str(exc))
    raise NcclError("could not load NCCL: " + "; ".join(errors))


def _wheel_library() -> list[str]:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = [os.path.join(d, _WHEEL_LIBRARY) for d in spec.submodule_search_locations]
    return [f for f in found if os.path.exists(f)]


def nccl_type(dtype: torch.dtype) -> tuple[int, int]:
    """``(NCCL type, bytes per element)`` to broadcast a tensor of ``dtype`` with."""
    if dtype in _NCCL_TYPES:
        return _NCCL_TYPES[dtype], dtype.itemsize
    return NCCL_UINT8, 1


class Communicator:
    """One non-blocking NCCL communicator on one CUDA device.

    Calls are serialized by a lock; :meth:`abort` may come from any thread and makes every later
    call fail with :class:`NcclError`."""

    def __init__(self, lib: NcclLibrary, handle: ctypes.c_void_p, device_index: int, rank: int, world_size: int):
        self.lib = lib
        self.device_index = device_index
        self.rank = rank
        self.world_size = world_size
        self._handle: ctypes.c_void_p | None = handle
        self._lock = threading.Lock()
        self._aborted = threading.Event()

    @classmethod
    def join(
        cls,
        lib: NcclLibrary,
        unique_id: bytes,
        *,
        rank: int,
        world_size: int,
        device_index: int,
        deadline: float,
        cancel: threading.Event | None = None,
    ) -> Communicator:
        """``ncclCommInitRank`` as ``rank`` of ``world_size``, settled by ``deadline`` (monotonic)
        or aborted; blocks until every rank has joined."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId.from_buffer_copy(unique_id)
        config = _Config(ctypes.sizeof(_Config), _CONFIG_MAGIC, _CONFIG_VERSION, 0)
        handle = _Comm()
        with torch.cuda.device(device_index):
            result = lib.fn["ncclCommInitRankConfig"](ctypes.byref(handle), world_size, uid, rank, ctypes.byref(config))
        comm = cls(lib, handle, device_index, rank, world_size)
        try:
            if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                raise NcclError(f"ncclCommInitRank failed: {lib.error_text(result)} ({result})")
            if not handle.value:
                raise NcclError("ncclCommInitRank returned no communicator")
            comm.settle("ncclCommInitRank", deadline, cancel)
        except BaseException:
            comm.abort()
            raise
        return comm

    # -- state ---------------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def async_state(self) -> int:
        """``ncclCommGetAsyncError``: ``NCCL_SUCCESS``, ``NCCL_IN_PROGRESS`` or an error code."""
        with self._lock:
            handle = self._live()
            state = ctypes.c_int()
            self.lib.check(self.lib.fn["ncclCommGetAsyncError"](handle, ctypes.byref(state)), "ncclCommGetAsyncError")
            return state.value

    def check_healthy(self) -> None:
        """Raise :class:`NcclError` if the communicator reported an asynchronous error."""
        state = self.async_state()
        if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(f"the NCCL communicator failed: {self.lib.error_text(state)} ({state})")

    def settle(self, what: str, deadline: float, cancel: threading.Event | None = None) -> None:
        """Poll until the last call has settled; :class:`NcclError` on error, deadline or cancel."""
        pause = 1e-4
        while True:
            state = self.async_state()
            if state == NCCL_SUCCESS:
                return
            if state != NCCL_IN_PROGRESS:
                raise NcclError(f"{what} failed: {self.lib.error_text(state)} ({state})")
            if cancel is not None and cancel.is_set():
                raise NcclError(f"{what} was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise NcclError(f"{what} did not complete in time (every rank must join with the same id)")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    # -- collectives ---------------------------------------------------------------------------

    def broadcast(self, ptr: int, count: int, nccl_dtype: int, root: int, stream: int, deadline: float) -> None:
        """Enqueue a broadcast from ``root`` into (or, on ``root``, out of) ``ptr`` on ``stream``."""
        with self._lock:
            handle = self._live()
            send = ptr if root == self.rank else None
            result = self.lib.fn["ncclBroadcast"](send, ptr, count, nccl_dtype, root, handle, stream)
        self._enqueued(result, "ncclBroadcast", deadline)

    def all_reduce(self, ptr: int, count: int, nccl_dtype: int, stream: int, deadline: float) -> None:
        """Enqueue an in-place sum all-reduce of ``ptr`` on ``stream``."""
        with self._lock:
            handle = self._live()
            result = self.lib.fn["ncclAllReduce"](ptr, ptr, count, nccl_dtype, NCCL_SUM, handle, stream)
        self._enqueued(result, "ncclAllReduce", deadline)

    def _enqueued(self, result: int, what: str, deadline: float) -> None:
        if result == NCCL_IN_PROGRESS:
            self.settle(what, deadline)
        elif result != NCCL_SUCCESS:
            raise NcclError(f"{what} failed: {self.lib.error_text(result)} ({result})")

    def _live(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise NcclError("the NCCL communicator was aborted")
        return self._handle

    # -- teardown ------------------------------------------------------------------------------

    def abort(self, wait_s: float = ABORT_WAIT_S) -> bool:
        """``ncclCommAbort`` (idempotent): stops any collective still running on the device.
        ``False`` when it did not finish within ``wait_s`` (it goes on on a daemon thread)."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is None:  # aborted before
            return self._aborted.wait(wait_s)
        if not handle.value:  # NCCL never returned a communicator: nothing to abort
            self._aborted.set()
            return True
        thread = threading.Thread(target=self._abort, args=(handle,), name="nccl-abort", daemon=True)
        thread.start()
        return self._aborted.wait(wait_s)

    def _abort(self, handle: ctypes.c_void_p) -> None:
        try:
            with torch.cuda.device(self.device_index):
                self.lib.fn["ncclCommAbort"](handle)
        finally:
            self._aborted.set()
