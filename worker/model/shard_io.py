"""Reading checkpoint files so that a stalled file system stalls only the reading thread.

Every file a checkpoint read opens must be a regular, non-empty file
(:func:`require_regular_file`): a FIFO, a device or a socket can block a read for
ever or never end, a directory is not a file, and files under ``/proc`` and
``/sys`` call themselves regular with size 0. ``os.stat`` releases the GIL, so a
stat on a hung mount stalls only its own thread.

Shard bytes are read with plain file I/O (:func:`read_regular_file`), which
releases the GIL during every read system call, in chunks, checking between
chunks whether the caller has given up. The tensors are then views of those
bytes (:func:`tensors_from_buffer`). ``safetensors.torch.load`` would parse them
too, but it only takes a ``bytes`` object: joining the chunks into one and its
own per-tensor copies are whole-shard copies made while holding the GIL, which
would stall the event loop for about a second per GiB.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as load_safetensors_bytes

from worker.model.weight_map import WeightLoadError

#: Bytes per read call: small enough to notice a caller that gave up, large enough to be cheap.
CHUNK_BYTES = 16 << 20
#: The safetensors format's own bound on the JSON header.
MAX_HEADER_BYTES = 100_000_000

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _ReadsInto(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


class ReadCancelled(WeightLoadError):
    """The caller stopped waiting for this read; what was read is dropped."""


def _named(path: Path) -> str:
    # Name the link's target too: "model.safetensors" pointing at /dev/zero must say so.
    return f"{path} (a link to {os.path.realpath(path)})" if os.path.islink(path) else str(path)


def _refusal(path: Path, st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((label for test, label in _KINDS if test(st.st_mode)), "not a regular file")
        return f"{_named(path)} is {kind}; every checkpoint file must be a regular file"
    if st.st_size == 0:
        return f"{_named(path)} is empty (size 0, as files under /proc and /sys report); it cannot be a checkpoint file"
    return None


def require_regular_file(path: Path) -> os.stat_result:
    """``os.stat(path)``, or :class:`WeightLoadError` naming the file unless it is a regular, non-empty file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise WeightLoadError(f"{_named(path)} does not exist") from None
    except OSError as exc:
        raise WeightLoadError(f"cannot stat {path}: {exc.strerror or exc}") from None
    problem = _refusal(path, st)
    if problem is not None:
        raise WeightLoadError(problem)
    return st


def open_checked(path: Path) -> int:
    """A read-only descriptor of ``path``, checked again on what was opened (the path may have changed)."""
    require_regular_file(path)
    # O_NONBLOCK: should a FIFO have replaced the file since the stat, opening it does not wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        problem = _refusal(path, os.fstat(fd))
        if problem is not None:
            raise WeightLoadError(problem)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: Path, cancel: threading.Event | None = None, chunk_bytes: int = CHUNK_BYTES) -> mmap.mmap:
    """The whole of a regular file in anonymous memory, read in chunks of ``chunk_bytes``.

    Raises :class:`ReadCancelled` at the first chunk boundary after ``cancel`` is set.
    Memory: one buffer of the file's size; its pages are filled by the kernel during
    the reads (without the GIL), not zeroed beforehand."""
    with open(open_checked(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        # Private anonymous memory: the process's own pages, not a shared (shmem) mapping.
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with memoryview(buf) as view:
            read_into(f, view, str(path), cancel, chunk_bytes)
    return buf


def read_into(
    f: _ReadsInto, view: memoryview, name: str, cancel: threading.Event | None, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Fill ``view`` from ``f`` (``readinto``), checking ``cancel`` before every chunk."""
    done, size = 0, len(view)
    while done < size:
        if cancel is not None and cancel.is_set():
            raise ReadCancelled(f"reading {name} was abandoned after {done} of {size} bytes")
        n = f.readinto(view[done : done + chunk_bytes])
        if not n:
            raise WeightLoadError(f"cannot read {name}: it ended after {done} of {size} bytes (changed while read?)")
        done += n


def tensors_from_buffer(buf: mmap.mmap, name: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in ``buf``: views of it, in file order.

    Checks what ``safetensors`` checks: a JSON header within bounds, known dtypes,
    sizes that match the shapes, and tensors that tile the data section exactly."""
    if sys.byteorder != "little":
        # The format is little-endian and views reinterpret bytes in host order: let the library swap them.
        try:
            return list(load_safetensors_bytes(bytes(buf)).items())
        except Exception as exc:
            raise WeightLoadError(f"cannot read {name}: {exc}") from None
    size = len(buf)
    header_len = int.from_bytes(buf[:8], "little") if size >= 8 else -1
    if header_len < 2 or header_len > min(MAX_HEADER_BYTES, size - 8):
        raise WeightLoadError(f"cannot read {name}: not a safetensors file (header length {header_len})")
    try:
        header = json.loads(buf[8 : 8 + header_len])
    except ValueError as exc:
        raise WeightLoadError(f"cannot read {name}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"cannot read {name}: its header is not a JSON object")
    header.pop("__metadata__", None)
    base, data_len = 8 + header_len, size - 8 - header_len
    entries = sorted((_entry(name, key, info, data_len) for key, info in header.items()), key=lambda e: e[2])
    end = 0
    for key, _, begin, stop in entries:
        if begin != end:
            raise WeightLoadError(f"cannot read {name}: tensor {key!r} overlaps or leaves a gap at byte {end}")
        end = stop
    if end != data_len:
        raise WeightLoadError(f"cannot read {name}: tensors cover {end} of {data_len} data bytes")
    by_offset = {
        key: _view(buf, base + begin, stop - begin, dtype, shape) for key, (dtype, shape), begin, stop in entries
    }
    return [(key, by_offset[key]) for key in header]


def _entry(name: str, key: str, info: Any, data_len: int) -> tuple[str, tuple[torch.dtype, list[int]], int, int]:
    problem = f"cannot read {name}: tensor {key!r} has a malformed entry"
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise WeightLoadError(f"{problem} (dtype {info.get('dtype') if isinstance(info, dict) else info!r})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise WeightLoadError(f"{problem} (shape {shape!r})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise WeightLoadError(f"{problem} (data_offsets {offsets!r})")
    begin, stop = offsets
    dtype = _DTYPES[info["dtype"]]
    if not 0 <= begin <= stop <= data_len or stop - begin != math.prod(shape) * dtype.itemsize:
        raise WeightLoadError(f"{problem} (data_offsets {offsets!r} for shape {shape} of {info['dtype']})")
    return key, (dtype, shape), begin, stop


def _view(buf: mmap.mmap, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    if offset % dtype.itemsize:
        # Misaligned for its dtype (the format does not promise alignment): a copy of its own.
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)
