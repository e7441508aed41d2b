"""Reading Hugging Face safetensors checkpoints (single file or sharded).

Every file a read touches (``config.json``, the index, each shard) must be a
regular, non-empty file (:mod:`worker.model.shard_io`). :func:`read_checkpoint`
reads through ``safetensors``' memory-mapped reader: it streams tensor by tensor
and is what the start-up load uses. A hot update from disk uses
:func:`read_checkpoint_chunked` instead: a read stuck on a hung file system then
stalls only its own thread (the memory-mapped reader blocks while holding the
GIL, freezing the whole process), and a caller that gave up can stop it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.causal_lm import CausalLM
from worker.model.config import ModelConfig
from worker.model.shard_io import ReadCancelled, read_regular_file, require_regular_file, tensors_from_buffer
from worker.model.tensor_parallel import TensorParallel
from worker.model.weight_map import WeightLoadError

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def check_config_file(path: str | Path) -> None:
    """Refuse a ``config.json`` that exists but is not a regular, non-empty file (a missing one is left to the caller)."""
    config = Path(path) / CONFIG_FILE
    if config.exists():
        require_regular_file(config)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, validated to exist as regular, non-empty files."""
    root = Path(path)
    if not root.is_dir():
        raise WeightLoadError(f"model path {str(path)!r} is not a directory")
    index = root / INDEX_FILE
    if index.exists():
        require_regular_file(index)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"cannot read {index}: {exc}") from None
        names = sorted(set(weight_map.values()))
        files = []
        for name in names:
            # Shard names come from a file on disk; keep them inside the checkpoint directory.
            candidate = (root / name).resolve()
            if root.resolve() not in candidate.parents:
                raise WeightLoadError(f"{INDEX_FILE} points outside the checkpoint: {name!r}")
            if not candidate.exists():
                raise WeightLoadError(f"{INDEX_FILE} lists a missing shard {name!r}")
            files.append(candidate)
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    for file in files:
        require_regular_file(file)
    return files


def read_checkpoint(path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs from every shard, cast to ``dtype`` on the CPU (memory-mapped reads)."""
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    tensor = handle.get_tensor(name)
                    yield name, tensor if tensor.dtype == dtype else tensor.to(dtype)
        except WeightLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise WeightLoadError(f"cannot read {file.name}: {exc}") from None


def read_checkpoint_chunked(
    path: str | Path, dtype: torch.dtype, *, cancel: threading.Event | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the checkpoint, cast to ``dtype``, read with plain file I/O.

    Each read call releases the GIL, so a file system that stops answering blocks
    only the calling thread. Between chunks and between shards the read checks
    ``cancel`` and raises :class:`~worker.model.shard_io.ReadCancelled` once it is set.

    Memory: the tensors are views of their shard's bytes, so the peak is the
    checkpoint's size (every shard's bytes, which are its tensors); tensors cast
    to another ``dtype`` are copies, and a shard's bytes are freed once none of its
    tensors is a view of them any more.
    """
    named: list[tuple[str, torch.Tensor]] = []
    for file in checkpoint_files(path):
        if cancel is not None and cancel.is_set():
            raise ReadCancelled(f"reading {path} was abandoned before {file.name}")
        try:
            buf = read_regular_file(file, cancel)
        except OSError as exc:
            raise WeightLoadError(f"cannot read {file.name}: {exc.strerror or exc}") from None
        for name, tensor in tensors_from_buffer(buf, file.name):
            named.append((name, tensor if tensor.dtype == dtype else tensor.to(dtype)))
    return named


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Build a model from ``config.json`` and load every tensor of the checkpoint (this rank's
    shard of each, on a tensor-parallel rank)."""
    check_config_file(path)
    config = ModelConfig.from_dir(path)
    model = CausalLM(config, dtype=dtype, device=device, tp=tp)
    model.load_weights(read_checkpoint(path, dtype), require_complete=True)
    return model
