"""What a vLLM server's weights look like to a trainer: checkpoint names, shapes and the served dtype.

vLLM fuses and shards parameters (``qkv_proj``, ``gate_up_proj``, packed CPU kernels), so its own
``named_parameters()`` are not what a trainer sends. A trainer sends checkpoint-named, full
tensors, which is exactly what vLLM's ``load_weights`` takes; so an announced update is checked
against the checkpoint the server was started from: the names and shapes in its safetensors
headers (read through ``safetensors``, no tensor bytes), in the dtype vLLM serves. Only a local
directory can be read that way, so a server started from a hub id is refused with a clear message.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.checkpoint import checkpoint_files
from worker.model.weight_map import WeightLoadError
from worker.transfer.validation import MetadataError, Spec

#: Names vLLM's loaders skip (rotary caches some checkpoints carry): accepted in an update, never required.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def checkpoint_spec(model: str, dtype: torch.dtype) -> Spec:
    """``{name: (dtype, shape)}`` of every tensor of the checkpoint directory ``model``.

    Raises :class:`MetadataError` when ``model`` is not a local directory of safetensors files."""
    root = Path(model)
    if not root.is_dir():
        raise MetadataError(
            f"the served model {model!r} is not a local directory: the omni weight sync checks updates against "
            "the checkpoint's safetensors headers, so start vLLM with --model <a local checkpoint directory>"
        )
    try:
        files = checkpoint_files(root)
    except WeightLoadError as exc:
        raise MetadataError(f"cannot read the served checkpoint: {exc}") from None
    spec: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                spec[name] = (dtype, tuple(int(d) for d in reader.get_slice(name).get_shape()))
    return spec


def ignored_names(tied_embeddings: bool) -> Callable[[str], bool]:
    """The names an update may carry that vLLM's loader skips: rotary caches, and ``lm_head.weight``
    of a model whose output embedding is tied to its input embedding."""

    def is_ignored(name: str) -> bool:
        if name.endswith(SKIPPED_SUFFIXES):
            return True
        return tied_embeddings and name == "lm_head.weight"

    return is_ignored


def missing_names(spec: Spec, sent: set[str], is_ignored: Callable[[str], bool]) -> list[str]:
    """Checkpoint tensors an update leaves out (sorted).

    vLLM's in-place reload rebuilds each layer from the tensors it is given (a fused ``qkv_proj``
    fed only ``q_proj`` would lose ``k`` and ``v``), so only a complete update can be applied safely."""
    return sorted(name for name in spec if name not in sent and not is_ignored(name))
