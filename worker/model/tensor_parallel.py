"""Megatron-style tensor parallelism: which slice of each weight a rank holds.

Every rank of a tensor-parallel group holds one shard of each large matrix and
runs the same forward pass in lockstep; the layout is Megatron-LM's, the one
vLLM and SGLang use for Llama / Qwen2:

====================  ===========================  ==========================================
fused parameter       split                        per rank
====================  ===========================  ==========================================
``qkv_proj`` (+bias)  column parallel, dim 0       ``[q_r | k_r | v_r]``: its q heads and the kv
                      per section, by head         heads they attend to (not one block cut of
                                                   the fused ``[q | k | v]``)
``gate_up_proj``      column parallel, dim 0       ``[gate_r | up_r]``: its slice of each half
                      per half
``o_proj``            row parallel, dim 1          a partial product, summed by one all-reduce;
                                                   the bias is added once, after the all-reduce
``down_proj``         row parallel, dim 1          likewise (no bias in these models)
norms                 replicated                   the whole vector
``embed_tokens``,     replicated                   the whole ``vocab × hidden`` matrix
``lm_head``
====================  ===========================  ==========================================

Embedding and LM head are replicated, not vocab-parallel: every rank then
computes the full-vocab logits itself (no all-gather, sampling needs no
cross-rank step) and a tied head is simply the embedding, on every rank. The
price is ``vocab × hidden`` per rank (Qwen2-7B in bf16: about 1.1 GB, twice
that untied); vocab-parallel embedding (vLLM's and SGLang's
``VocabParallelEmbedding``) saves it on big vocabularies at the cost of an
all-reduce after the lookup and an all-gather of the logits. It would be a
``ShardSpec(dim=0)`` on those two names and a gather in the head.

GQA with fewer kv heads than ranks replicates kv heads, as vLLM and SGLang do:
the size must then be a multiple of ``num_key_value_heads``, and the
``size // num_key_value_heads`` consecutive ranks that share a kv head are
exactly the ranks whose q heads attend to it. Sizes that do not divide the
heads or the intermediate size are refused with a :class:`ValueError`.

Checkpoint names stay per section (``q_proj``, ``k_proj``, ``gate_proj``...),
so each name's shard is one contiguous slice of the full tensor along one dim:
:class:`ShardSpec` cuts it for loading and glues every rank's shard back
together (:meth:`ShardSpec.full_tensor`), which is what a leader needs to digest
full tensors the way a trainer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.model.config import ModelConfig

_COLUMN_SUFFIXES = ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")
_KV_SUFFIXES = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_ROW_SUFFIXES = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; ``group`` is None only at size 1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")
        if self.size > 1:
            if self.group is None:
                raise ValueError(f"tensor-parallel size {self.size} needs a process group")
            if (self.group.rank(), self.group.size()) != (self.rank, self.size):
                raise ValueError(
                    f"process group is rank {self.group.rank()} of {self.group.size()}, "
                    f"not rank {self.rank} of {self.size}"
                )

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> TensorParallel:
        return cls(group.rank(), group.size(), group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t``."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on each), in rank order."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out


@dataclass(frozen=True)
class ShardLayout:
    """Per-rank sizes of the sharded dimensions for one config and group size."""

    size: int
    heads: int
    kv_heads: int
    kv_replicas: int
    """Consecutive ranks holding the same kv head (1 unless kv heads < size)."""
    intermediate: int


def shard_layout(cfg: ModelConfig, size: int) -> ShardLayout:
    """The per-rank sizes, or a ValueError naming the numbers that do not divide."""
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % size:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor-parallel size {size}")
    if inter % size:
        raise ValueError(f"intermediate_size={inter} is not divisible by tensor-parallel size {size}")
    if kv >= size and kv % size:
        raise ValueError(f"num_key_value_heads={kv} is not divisible by tensor-parallel size {size}")
    if kv < size and size % kv:
        raise ValueError(
            f"num_key_value_heads={kv} is fewer than tensor-parallel size {size}; kv heads are then "
            f"replicated, which needs the size to be a multiple of {kv}"
        )
    replicas = max(1, size // kv)
    return ShardLayout(size, heads // size, kv * replicas // size, replicas, inter // size)


@dataclass(frozen=True)
class ShardSpec:
    """How one checkpoint tensor is split: along ``dim`` into ``size // replicas``
    equal slices, rank ``r`` holding slice ``r // replicas``; ``dim`` None means
    every rank holds the whole tensor."""

    dim: int | None = None
    size: int = 1
    replicas: int = 1

    @property
    def parts(self) -> int:
        return 1 if self.dim is None else self.size // self.replicas

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.parts
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of ``full`` (a view; ``full`` itself when nothing is split)."""
        if self.dim is None or self.parts == 1:
            return full
        chunk = full.shape[self.dim] // self.parts
        return full.narrow(self.dim, (rank // self.replicas) * chunk, chunk)

    def full_tensor(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order.

        Copies that should be equal (replicated tensors, replicated kv heads) are
        checked: a rank that diverged makes this raise instead of letting a
        digest of one copy vouch for all of them.
        """
        if len(shards) != self.size:
            raise ValueError(f"expected {self.size} shards, got {len(shards)}")
        step = self.replicas if self.dim is not None else self.size
        for index, shard in enumerate(shards):
            first = index - index % step
            if first != index and not torch.equal(shard, shards[first]):
                raise ValueError(f"rank {index}'s copy differs from rank {first}'s")
        if self.dim is None or self.parts == 1:
            return shards[0]
        return torch.cat(list(shards[:: self.replicas]), dim=self.dim)


def checkpoint_shard_spec(name: str, layout: ShardLayout) -> ShardSpec:
    """The split of checkpoint tensor ``name`` (the table in the module docstring)."""
    if name.endswith(_COLUMN_SUFFIXES):
        return ShardSpec(0, layout.size)
    if name.endswith(_KV_SUFFIXES):
        return ShardSpec(0, layout.size, layout.kv_replicas)
    if name.endswith(_ROW_SUFFIXES):
        return ShardSpec(1, layout.size)
    return ShardSpec(None, layout.size)
