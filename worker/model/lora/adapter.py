"""A PEFT LoRA adapter as written: its config and its ``lora_A`` / ``lora_B`` tensors by layer and module.

PEFT's ``save_pretrained`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``). Only safetensors is read: an
``adapter_model.bin`` is a pickle, and unpickling runs whatever code it names.

What can be checked without a model is checked here (names, pairs, ranks,
targets matching the config); shapes against a model, layer counts and the
rank limit are checked when the adapter is placed on a model
(:mod:`worker.model.lora.loaded`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from router.dataplane.digest import adapter_checksum
from worker.model.lora.config import TARGET_MODULES, LoraConfig, LoraLoadError, raise_problems
from worker.model.shard_io import read_regular_file, tensors_from_buffer
from worker.model.weight_map import WeightLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"

# PEFT's saved names; the ``base_model.model.`` prefix (PeftModel wrapping the causal LM) is optional.
_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d{1,9})\.(?P<block>self_attn|mlp)\."
    r"(?P<module>[a-z_]+)\.lora_(?P<part>[AB])\.weight"
)


@dataclass(frozen=True)
class LoraPair:
    """One module's low-rank update ``B @ A`` (unscaled), as stored."""

    a: torch.Tensor
    """``[r, in_features]``."""
    b: torch.Tensor
    """``[out_features, r]``."""


@dataclass(frozen=True)
class LoraAdapter:
    """A parsed adapter, not yet tied to a model: ``weights[(layer, module)]``."""

    config: LoraConfig
    weights: Mapping[tuple[int, str], LoraPair]

    @classmethod
    def from_dir(cls, path: str | Path) -> LoraAdapter:
        """Read a directory written by PEFT's ``save_pretrained``."""
        root = Path(path)
        if not root.is_dir():
            raise LoraLoadError(f"adapter path {str(path)!r} is not a directory")
        weights_file = root / WEIGHTS_FILE
        if not weights_file.exists():
            if (root / PICKLED_WEIGHTS_FILE).exists():
                raise LoraLoadError(
                    f"{root} holds only {PICKLED_WEIGHTS_FILE}, a pickle, which is never loaded (unpickling can run "
                    f"arbitrary code); save the adapter as {WEIGHTS_FILE} (PEFT's default, safe_serialization=True)"
                )
            raise LoraLoadError(f"no {WEIGHTS_FILE} in {root}")
        try:
            config = json.loads(bytes(read_regular_file(root / CONFIG_FILE)))
            tensors = dict(tensors_from_buffer(read_regular_file(weights_file), WEIGHTS_FILE))
        except WeightLoadError as exc:
            raise LoraLoadError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise LoraLoadError(f"cannot read {root / CONFIG_FILE}: {exc}") from None
        return cls.from_tensors(config, tensors)

    @classmethod
    def from_tensors(cls, config: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> LoraAdapter:
        """An adapter from its config (``adapter_config.json``'s fields) and PEFT-named tensors."""
        cfg = LoraConfig.from_dict(config)
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        problems: list[str] = []
        for name, tensor in tensors.items():
            match = _NAME.fullmatch(name)
            if match is None:
                problems.append(f"unexpected tensor {name!r} (not a lora_A / lora_B weight of a decoder layer)")
                continue
            module = match["module"]
            if TARGET_MODULES.get(module) != match["block"]:
                problems.append(f"{name}: {match['block']}.{module} is not a module an adapter may target")
                continue
            if module not in cfg.targets:
                problems.append(f"{name}: {module} is not in target_modules {sorted(cfg.targets)}")
                continue
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                problems.append(f"{name}: not a floating-point tensor")
                continue
            parts.setdefault((int(match["layer"]), module), {})[match["part"]] = tensor
        weights: dict[tuple[int, str], LoraPair] = {}
        for (layer, module), pair in sorted(parts.items()):
            where = f"layer {layer} {module}"
            if pair.keys() != {"A", "B"}:
                problems.append(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
                continue
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != cfg.rank or b.shape[1] != cfg.rank:
                problems.append(
                    f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r] "
                    f"with r={cfg.rank}"
                )
                continue
            weights[(layer, module)] = LoraPair(a, b)
        if not weights and not problems:
            problems.append("no lora_A / lora_B tensors")
        raise_problems(problems, "the adapter")
        return cls(cfg, weights)

    def checksum(self) -> str:
        """The checksum of the tensors as read, under PEFT's names (:func:`router.dataplane.digest.adapter_checksum`):
        what a trainer computes from the adapter it saved or sent."""
        return adapter_checksum(
            (f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}.lora_{part}.weight", tensor)
            for (layer, module), pair in self.weights.items()
            for part, tensor in (("A", pair.a), ("B", pair.b))
        )

    def on_cpu(self) -> LoraAdapter:
        """A copy whose tensors are contiguous, on the CPU and its own (sharing no storage with this one's):
        what rank 0 of a tensor-parallel worker hands the other ranks, each on its own device, to place."""

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)

        return LoraAdapter(self.config, {key: LoraPair(own(p.a), own(p.b)) for key, p in self.weights.items()})
