"""Checkpoint names ↔ fused serving parameters.

Hugging Face checkpoints store ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` separately; the model holds them as row shards of
``qkv_proj`` and ``gate_up_proj``. This module is the one place that knows the
correspondence, in both directions: loading (name → shard to copy into) and
inspection (name → live view, used by the weights checker and by trainers that
verify what a worker holds).

Under tensor parallelism (:mod:`worker.model.tensor_parallel`) the contract
stays SGLang's: loading takes the FULL checkpoint-named tensors, exactly what a
single rank takes, validates them against the full checkpoint shapes, and each
rank copies only its slice. Every rank receives the same tensors and reaches
the same verdict, so a refused update leaves every rank untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.model.config import ModelConfig
from worker.model.tensor_parallel import ShardLayout, ShardSpec, TensorParallel, checkpoint_shard_spec


class MappedModel(Protocol):
    """What the map reads of the model it serves (:class:`~worker.model.causal_lm.CausalLM`),
    named here so that the map does not import the model that owns it."""

    config: ModelConfig
    layout: ShardLayout
    dtype: torch.dtype
    tp: TensorParallel

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


# Names that appear in some checkpoints but carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the model; raised before anything is modified."""


@dataclass(frozen=True)
class _Target:
    param: torch.Tensor
    start: int  # row range inside the (local) fused parameter
    stop: int
    full_shape: tuple[int, ...]  # the checkpoint tensor's shape, before sharding
    shard: ShardSpec  # which slice of the checkpoint tensor this rank holds

    def view(self) -> torch.Tensor:
        return self.param.data[self.start : self.stop]


class WeightMap:
    """Resolves checkpoint names to row ranges of the model's parameters."""

    def __init__(self, model: MappedModel):
        cfg = model.config
        layout = model.layout
        # This rank's sizes: the fused parameters hold only its sections.
        q = layout.heads * cfg.head_dim
        kv = layout.kv_heads * cfg.head_dim
        inter = layout.intermediate
        params = dict(model.named_parameters())
        self.dtype = model.dtype
        self.rank = model.tp.rank
        self._targets: dict[str, _Target] = {}
        self._tied_aliases: set[str] = set()

        def add(name: str, param_name: str, start: int | None = None, stop: int | None = None) -> None:
            param = params[param_name]
            start = start or 0
            stop = param.shape[0] if stop is None else stop
            shard = checkpoint_shard_spec(name, layout)
            full_shape = shard.full_shape((stop - start, *param.shape[1:]))
            self._targets[name] = _Target(param, start, stop, full_shape, shard)

        add("model.embed_tokens.weight", "model.embed_tokens.weight")
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}"
            kinds = ["weight", "bias"] if cfg.qkv_bias else ["weight"]
            for kind in kinds:
                fused = f"{pre}.self_attn.qkv_proj.{kind}"
                add(f"{pre}.self_attn.q_proj.{kind}", fused, 0, q)
                add(f"{pre}.self_attn.k_proj.{kind}", fused, q, q + kv)
                add(f"{pre}.self_attn.v_proj.{kind}", fused, q + kv, q + 2 * kv)
            add(f"{pre}.self_attn.o_proj.weight", f"{pre}.self_attn.o_proj.weight")
            if cfg.o_bias:
                add(f"{pre}.self_attn.o_proj.bias", f"{pre}.self_attn.o_proj.bias")
            add(f"{pre}.mlp.gate_proj.weight", f"{pre}.mlp.gate_up_proj.weight", 0, inter)
            add(f"{pre}.mlp.up_proj.weight", f"{pre}.mlp.gate_up_proj.weight", inter, 2 * inter)
            add(f"{pre}.mlp.down_proj.weight", f"{pre}.mlp.down_proj.weight")
            add(f"{pre}.input_layernorm.weight", f"{pre}.input_layernorm.weight")
            add(f"{pre}.post_attention_layernorm.weight", f"{pre}.post_attention_layernorm.weight")
        add("model.norm.weight", "model.norm.weight")
        if cfg.tie_word_embeddings:
            # Tied checkpoints may still carry lm_head.weight (a copy of the
            # embedding); it is accepted and skipped, as serving engines do.
            self._tied_aliases.add("lm_head.weight")
        else:
            add("lm_head.weight", "lm_head.weight")

    def spec(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Full checkpoint shapes (what a trainer sends), whatever this rank holds."""
        return {name: (t.param.dtype, t.full_shape) for name, t in self._targets.items()}

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {name: t.shard for name, t in self._targets.items()}

    def iter_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Live views of what this rank holds of each checkpoint tensor (all of it at size 1)."""
        for name, target in self._targets.items():
            yield name, target.view()

    def is_ignored(self, name: str) -> bool:
        return name in self._tied_aliases or name.endswith(_IGNORED_SUFFIXES)

    def validate(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, require_complete: bool = False
    ) -> list[tuple[_Target, torch.Tensor]]:
        """Check every tensor; return the copy plan or raise WeightLoadError listing the problems."""
        plan: list[tuple[_Target, torch.Tensor]] = []
        problems: list[str] = []
        seen: set[str] = set()
        for name, tensor in weights:
            if self.is_ignored(name):
                continue
            target = self._targets.get(name)
            if target is None:
                problems.append(f"unknown parameter name {name!r}")
                continue
            if name in seen:
                problems.append(f"duplicate parameter name {name!r}")
                continue
            seen.add(name)
            expected_shape = target.full_shape
            if tuple(tensor.shape) != expected_shape:
                problems.append(f"{name}: shape {tuple(tensor.shape)} does not match the model's {expected_shape}")
                continue
            if tensor.dtype != target.param.dtype:
                problems.append(
                    f"{name}: dtype {_dtype_name(tensor.dtype)} does not match the model's {_dtype_name(target.param.dtype)}"
                )
                continue
            plan.append((target, tensor))
        if require_complete:
            missing = [name for name in self._targets if name not in seen]
            if missing:
                problems.append(f"{len(missing)} checkpoint tensors missing, e.g. {missing[:3]}")
        if problems:
            shown = "; ".join(problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightLoadError(f"{len(problems)} problem(s) loading weights: {shown}{more}")
        return plan

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], *, require_complete: bool = False) -> int:
        plan = self.validate(weights, require_complete=require_complete)
        with torch.no_grad():
            for target, tensor in plan:
                target.view().copy_(target.shard.shard(tensor, self.rank), non_blocking=True)
        return len(plan)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
