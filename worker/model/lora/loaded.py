"""An adapter placed on one model rank: checked against its shapes, sliced, fused, ready to add.

The model holds ``q/k/v_proj`` fused as ``qkv_proj`` and ``gate/up_proj`` as
``gate_up_proj`` (:mod:`worker.model.weight_map`), so an adapter is regrouped by
the fused projection it adds to: the ``lora_A`` matrices of one projection are
stacked, ``x @ A_stack.T`` runs once for all of them, and each module's
``lora_B`` writes its own column section of the fused output. The scaling is
folded into ``lora_B`` once, here, instead of multiplying every step.

Under tensor parallelism (:mod:`worker.model.tensor_parallel`) each rank keeps
the slice matching its slice of the base weight:

- column-parallel modules (q, k, v, gate, up): ``A`` whole, ``B`` cut by the
  rank's output rows (its heads, its kv heads, its intermediate slice);
- row-parallel modules (o, down): ``A`` cut by the rank's input columns, ``B``
  whole. The rank's partial ``(x_r @ A_r.T) @ B.T`` is added to its partial base
  product before the layer's all-reduce: the sum over ranks is the full update,
  so an adapter costs no collective of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.lora.adapter import LoraAdapter
from worker.model.lora.config import TARGET_MODULES, LoraConfig, raise_problems
from worker.model.tensor_parallel import ShardLayout, TensorParallel, checkpoint_shard_spec

#: The model's fused projections an adapter adds to.
Projection = Literal["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
#: The fused projection of each target module, its modules in the fused output's column order.
FUSED: dict[Projection, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoraHost(Protocol):
    """What placing an adapter reads of the model (:class:`~worker.model.causal_lm.CausalLM`)."""

    config: ModelConfig
    layout: ShardLayout
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel


@dataclass(frozen=True)
class Placement:
    """One rank of one model: the shapes an adapter must fit, the slice it keeps, where its tensors live."""

    config: ModelConfig
    layout: ShardLayout
    rank: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: LoraHost) -> Placement:
        return cls(model.config, model.layout, model.tp.rank, model.dtype, model.device)

    def full_shape(self, module: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of ``module``'s unsharded base weight."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        return {
            "q_proj": (q, hidden),
            "k_proj": (kv, hidden),
            "v_proj": (kv, hidden),
            "o_proj": (hidden, q),
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
        }[module]


@dataclass(frozen=True)
class _Section:
    b: torch.Tensor
    """This rank's ``lora_B`` rows, scaled: ``[out_local, r]``."""
    columns: slice
    """Its columns in the fused projection's (local) output."""
    ranks: slice
    """Its rows of the stacked ``A``."""


@dataclass(frozen=True)
class ProjectionLora:
    """An adapter's update of one fused projection in one layer."""

    a: torch.Tensor
    """The stacked ``lora_A`` of its modules (input columns cut on row-parallel projections)."""
    sections: tuple[_Section, ...]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor) -> None:
        """Add the update of the token ``rows`` of input ``x`` to those rows of the projection output ``out``."""
        xa = F.linear(x[rows], self.a)
        for section in self.sections:
            out[rows, section.columns] += F.linear(xa[:, section.ranks], section.b)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *(s.b for s in self.sections)))


@dataclass(frozen=True, eq=False)
class LoadedLora:
    """An adapter ready to serve on one model rank; compared by identity, so two loads are two adapters."""

    name: str
    version: int
    """Counts the loads of ``name``: a reload is a new version."""
    config: LoraConfig
    layers: tuple[Mapping[Projection, ProjectionLora], ...]
    """Per decoder layer, the projections the adapter changes."""

    def nbytes(self) -> int:
        return sum(p.nbytes() for layer in self.layers for p in layer.values())


def place_adapter(adapter: LoraAdapter, placement: Placement, *, max_rank: int, name: str, version: int) -> LoadedLora:
    """This rank's copy of ``adapter``, or :class:`LoraLoadError` naming every mismatch with the model.

    Every check runs before the first tensor is copied; the copies are the
    adapter's own (converted to the model's dtype, on its device), never views
    of the caller's tensors.
    """
    cfg = adapter.config
    layers = placement.config.num_hidden_layers
    problems: list[str] = []
    if cfg.rank > max_rank:
        problems.append(f"rank r={cfg.rank} is above the limit max_lora_rank={max_rank}")
    for layer, module in adapter.weights:
        if layer >= layers:
            problems.append(f"{module} of layer {layer}: the model has {layers} layers")
    missing = [(i, m) for m in sorted(cfg.targets) for i in range(layers) if (i, m) not in adapter.weights]
    if missing:
        problems.append(f"{len(missing)} targeted modules have no weights, e.g. layer {missing[0][0]} {missing[0][1]}")
    for (layer, module), pair in sorted(adapter.weights.items()):
        out_features, in_features = placement.full_shape(module)
        expected_a, expected_b = (cfg.rank, in_features), (out_features, cfg.rank)
        if tuple(pair.a.shape) != expected_a or tuple(pair.b.shape) != expected_b:
            problems.append(
                f"layer {layer} {module}: lora_A {tuple(pair.a.shape)} and lora_B {tuple(pair.b.shape)} do not fit the "
                f"model's {expected_a} and {expected_b}"
            )
    raise_problems(problems, f"adapter {name!r}")
    placed = tuple(
        {
            projection: _place_projection(adapter, placement, layer, modules)
            for projection, modules in FUSED.items()
            if any(m in cfg.targets for m in modules)
        }
        for layer in range(layers)
    )
    return LoadedLora(name, version, cfg, placed)


def _place_projection(
    adapter: LoraAdapter, placement: Placement, layer: int, modules: tuple[str, ...]
) -> ProjectionLora:
    cfg, layout = adapter.config, placement.layout
    scaling = cfg.scaling
    a_parts: list[torch.Tensor] = []
    sections: list[_Section] = []
    column = 0
    for module in modules:
        spec = checkpoint_shard_spec(f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}.weight", layout)
        out_local = placement.full_shape(module)[0] // (spec.parts if spec.dim == 0 else 1)
        if module in cfg.targets:
            pair = adapter.weights[(layer, module)]
            a = pair.a if spec.dim != 1 else spec.shard(pair.a, placement.rank)
            b = pair.b if spec.dim != 0 else spec.shard(pair.b, placement.rank)
            start = len(a_parts) * cfg.rank
            a_parts.append(a)
            # Scaled in float32 or wider, rounded to the model's dtype once.
            wide = torch.promote_types(torch.promote_types(b.dtype, placement.dtype), torch.float32)
            scaled = b.to(wide) * scaling
            sections.append(
                _Section(_own(scaled, placement), slice(column, column + out_local), slice(start, start + cfg.rank))
            )
        column += out_local
    stacked = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts)
    return ProjectionLora(_own(stacked, placement), tuple(sections))


def _own(t: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A contiguous copy in the model's dtype and on its device, sharing no storage with ``t``."""
    return t.to(device=placement.device, dtype=placement.dtype, copy=True, memory_format=torch.contiguous_format)
