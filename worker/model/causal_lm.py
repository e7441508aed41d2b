"""A Llama / Qwen2 causal LM with serving-engine parameter layout.

Parameters are held fused the way serving engines hold them (``qkv_proj``,
``gate_up_proj``); :mod:`worker.model.weight_map` maps checkpoint names onto
them. The forward pass is ragged: linear layers run over the concatenated new
tokens of every sequence in the batch, attention runs per sequence over its own
cache. A sequence's numbers therefore do not depend on which other sequences
share its batch (no padding).

With a :class:`~worker.model.tensor_parallel.TensorParallel` of size > 1 the
model holds one rank's Megatron shard (see that module for the layout): its q
and kv heads, its slice of the MLP, and a KV cache of its kv heads only. All
ranks run ``forward_batch`` in lockstep on the same inputs; the row-parallel
layers sum their partial products with one all-reduce each, so every rank ends
with the same hidden states and the same full-vocab logits.

LoRA adapters (:mod:`worker.model.lora`) are applied unmerged, per sequence: a
sequence names its :class:`~worker.model.lora.LoadedLora` (None: the base
model) and each projection adds every adapter's low-rank update to the rows of
the sequences using it. A batch in which no sequence names one runs exactly the
base computation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.layers import Rotary, attend, rms_norm
from worker.model.lora.batch import LoraBatch
from worker.model.lora.loaded import LoadedLora, Projection
from worker.model.tensor_parallel import ShardLayout, ShardSpec, TensorParallel, shard_layout
from worker.model.weight_map import WeightMap


@dataclass
class SeqInput:
    """New tokens of one sequence, appended after ``kv.length``."""

    token_ids: list[int]
    kv: KVCache
    adapter: LoadedLora | None = None
    """The LoRA adapter this sequence is served with; None for the base model. Its KV cache was
    (and must keep being) computed with the same adapter."""


class _Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout):
        super().__init__()
        q = layout.heads * cfg.head_dim
        kv = layout.kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)


class _Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * layout.intermediate, bias=False)
        self.down_proj = nn.Linear(layout.intermediate, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout):
        super().__init__()
        self.self_attn = _Attention(cfg, layout)
        self.mlp = _Mlp(cfg, layout)
        self.input_layernorm = _Norm(cfg.hidden_size)
        self.post_attention_layernorm = _Norm(cfg.hidden_size)


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg, layout) for _ in range(cfg.num_hidden_layers))
        self.norm = _Norm(cfg.hidden_size)

    @property
    def typed_layers(self) -> Sequence[_Layer]:
        """The decoder layers with their type (an ``nn.ModuleList`` yields plain modules to a type checker)."""
        return cast("Sequence[_Layer]", self.layers)


class CausalLM(nn.Module):
    """Inference-only causal LM; parameter names follow the fused serving layout."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp or TensorParallel()
        # Raises on sizes that do not divide, before anything is allocated.
        self.layout = shard_layout(cfg, self.tp.size)
        # Build on the meta device, then allocate uninitialised storage: random
        # init would be wasted work, every tensor is overwritten by a checkpoint.
        with torch.device("meta"):
            self.model = _Decoder(cfg, self.layout)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to_empty(device=self.device)
        self.to(dtype)
        for param in self.parameters():
            param.requires_grad_(False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, self.device)
        self.weight_map = WeightMap(self)

    # -- weights -----------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, require_complete: bool = False) -> int:
        """Copy checkpoint-named tensors into the fused parameters.

        The tensors are the full checkpoint tensors at every tensor-parallel
        size; each rank copies its own slice. Every name, shape and dtype is validated before any parameter changes;
        on a problem :class:`~worker.model.weight_map.WeightLoadError` is raised
        and the model is untouched. With ``require_complete`` every checkpoint
        tensor of the model must be present (a full reload). Returns the number
        of tensors copied.
        """
        return self.weight_map.load(weights, require_complete=require_complete)

    def validate_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, require_complete: bool = False) -> None:
        """Check names, shapes and dtypes as :meth:`load_weights` would, without copying anything."""
        self.weight_map.validate(weights, require_complete=require_complete)

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint names that are accepted but carry nothing to load (e.g. a tied ``lm_head``)."""
        return self.weight_map.is_ignored(name)

    def checkpoint_spec(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every checkpoint name the model accepts, with its expected dtype and full (unsharded) shape."""
        return self.weight_map.spec()

    def iter_checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named views into the live parameters, in canonical order.

        At tensor-parallel size > 1 each view is this rank's shard of the
        checkpoint tensor; :meth:`shard_specs` rebuilds the full tensor from
        every rank's shard (``spec.full_tensor(shards)``).
        """
        return self.weight_map.iter_views()

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each checkpoint tensor is split across the tensor-parallel ranks."""
        return self.weight_map.shard_specs()

    def parameter_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # -- inference ----------------------------------------------------------------
    def new_kv_cache(self, capacity_tokens: int) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            self.layout.kv_heads,
            cfg.head_dim,
            capacity_tokens,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward_batch(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Float32 logits ``[len(seqs), vocab]`` of each sequence's last new token."""
        hidden = self._hidden(seqs)
        ends = torch.tensor([len(s.token_ids) for s in seqs], device=self.device).cumsum(0) - 1
        return self._logits(hidden[ends])

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor, adapter: LoadedLora | None = None) -> torch.Tensor:
        """Float32 logits ``[1, T, vocab]`` for every position of one sequence (no cache kept)."""
        ids = input_ids.reshape(-1).tolist()
        hidden = self._hidden([SeqInput(ids, self.new_kv_cache(len(ids)), adapter)])
        return self._logits(hidden)[None]

    def forward_logits(self, input_ids: torch.Tensor, adapter: LoadedLora | None = None) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` of one sequence, differentiable (for trainers).

        The same math as serving, outside inference mode: a trainer that turns
        ``requires_grad`` on can back-propagate through it (at tensor-parallel
        size 1: the all-reduces of a sharded model are invisible to autograd,
        Megatron's conjugate f/g operators are not implemented here).
        """
        if self.tp.size > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise NotImplementedError("gradients through a tensor-parallel model are not supported")
        ids = input_ids.reshape(-1).tolist()
        return self._logits(self._hidden([SeqInput(ids, self.new_kv_cache(len(ids)), adapter)]))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(hidden, self.model.norm.weight, self.config.rms_norm_eps)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    def _hidden(self, seqs: list[SeqInput]) -> torch.Tensor:
        cfg = self.config
        lengths = [len(s.token_ids) for s in seqs]
        if not seqs or min(lengths) == 0:
            raise ValueError("every sequence in a batch needs at least one new token")
        for seq, n in zip(seqs, lengths, strict=True):
            seq.kv.reserve(seq.kv.length + n)
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat(
            [torch.arange(s.kv.length, s.kv.length + n, device=self.device) for s, n in zip(seqs, lengths, strict=True)]
        )
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        heads, kv_heads = self.layout.heads, self.layout.kv_heads
        q_size = heads * cfg.head_dim
        kv_size = kv_heads * cfg.head_dim
        lora = LoraBatch.of([s.adapter for s in seqs], lengths, self.device)

        hidden = F.embedding(ids, self.model.embed_tokens.weight)
        for index, layer in enumerate(self.model.typed_layers):
            x = rms_norm(hidden, layer.input_layernorm.weight, cfg.rms_norm_eps)
            qkv = layer.self_attn.qkv_proj(x)
            if lora is not None:
                lora.add(index, "qkv_proj", x, qkv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = Rotary.apply(q.view(-1, heads, cfg.head_dim), cos, sin)
            k = Rotary.apply(k.view(-1, kv_heads, cfg.head_dim), cos, sin)
            v = v.view(-1, kv_heads, cfg.head_dim)
            outputs = []
            start = 0
            for seq, n in zip(seqs, lengths, strict=True):
                past = seq.kv.length
                keys = seq.kv.keys[index]
                values = seq.kv.values[index]
                keys[:, past : past + n] = k[start : start + n].transpose(0, 1)
                values[:, past : past + n] = v[start : start + n].transpose(0, 1)
                outputs.append(
                    attend(q[start : start + n].transpose(0, 1), keys[:, : past + n], values[:, : past + n], past)
                )
                start += n
            hidden = hidden + self._row_parallel(layer.self_attn.o_proj, torch.cat(outputs), lora, index, "o_proj")
            x = rms_norm(hidden, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            gate_up = layer.mlp.gate_up_proj(x)
            if lora is not None:
                lora.add(index, "gate_up_proj", x, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + self._row_parallel(layer.mlp.down_proj, F.silu(gate) * up, lora, index, "down_proj")
        for seq, n in zip(seqs, lengths, strict=True):
            seq.kv.length += n
        return hidden

    def _row_parallel(
        self, linear: nn.Linear, x: torch.Tensor, lora: LoraBatch | None, layer: int, projection: Projection
    ) -> torch.Tensor:
        """A row-parallel linear: local partial product, one all-reduce, then the bias once.

        Adapter updates join the partial product before the all-reduce: each rank
        holds the input columns of ``lora_A`` its input slice meets, so the sum
        over ranks is the full update (:mod:`worker.model.lora.loaded`).
        """
        if self.tp.size == 1:
            out: torch.Tensor = linear(x)
            if lora is not None:
                lora.add(layer, projection, x, out)
            return out
        out = F.linear(x, linear.weight)
        if lora is not None:
            lora.add(layer, projection, x, out)
        out = self.tp.all_reduce(out)
        return out if linear.bias is None else out + linear.bias
