"""Reading Hugging Face safetensors checkpoints (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.causal_lm import CausalLM
from worker.model.config import ModelConfig
from worker.model.weight_map import WeightLoadError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, validated to exist."""
    root = Path(path)
    if not root.is_dir():
        raise WeightLoadError(f"model path {str(path)!r} is not a directory")
    index = root / INDEX_FILE
    if index.exists():
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
            if not candidate.is_file():
                raise WeightLoadError(f"{INDEX_FILE} lists a missing shard {name!r}")
            files.append(candidate)
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    return files


def read_checkpoint(path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs from every shard, cast to ``dtype`` on the CPU."""
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


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """Build a model from ``config.json`` and load every tensor of the checkpoint."""
    config = ModelConfig.from_dir(path)
    model = CausalLM(config, dtype=dtype, device=device)
    model.load_weights(read_checkpoint(path, dtype), require_complete=True)
    return model
