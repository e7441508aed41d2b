"""A Llama / Qwen2 causal LM with serving-engine parameter layout.

Parameters are held fused the way serving engines hold them (``qkv_proj``,
``gate_up_proj``); :mod:`worker.model.weight_map` maps checkpoint names onto
them. The forward pass is ragged: linear layers run over the concatenated new
tokens of every sequence in the batch, attention runs per sequence over its own
cache. A sequence's numbers therefore do not depend on which other sequences
share its batch (no padding).
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
from worker.model.weight_map import WeightMap


@dataclass
class SeqInput:
    """New tokens of one sequence, appended after ``kv.length``."""

    token_ids: list[int]
    kv: KVCache


class _Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)


class _Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = _Norm(cfg.hidden_size)
        self.post_attention_layernorm = _Norm(cfg.hidden_size)


class _Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _Norm(cfg.hidden_size)

    @property
    def typed_layers(self) -> Sequence[_Layer]:
        """The decoder layers with their type (an ``nn.ModuleList`` yields plain modules to a type checker)."""
        return cast("Sequence[_Layer]", self.layers)


class CausalLM(nn.Module):
    """Inference-only causal LM; parameter names follow the fused serving layout."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # Build on the meta device, then allocate uninitialised storage: random
        # init would be wasted work, every tensor is overwritten by a checkpoint.
        with torch.device("meta"):
            self.model = _Decoder(cfg)
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

        Every name, shape and dtype is validated before any parameter changes;
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
        """Every checkpoint name the model accepts, with its expected dtype and shape."""
        return self.weight_map.spec()

    def iter_checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named views into the live parameters, in canonical order."""
        return self.weight_map.iter_views()

    def parameter_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # -- inference ----------------------------------------------------------------
    def new_kv_cache(self, capacity_tokens: int) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
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
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[1, T, vocab]`` for every position of one sequence (no cache kept)."""
        ids = input_ids.reshape(-1).tolist()
        hidden = self._hidden([SeqInput(ids, self.new_kv_cache(len(ids)))])
        return self._logits(hidden)[None]

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` of one sequence, differentiable (for trainers).

        The same math as serving, outside inference mode: a trainer that turns
        ``requires_grad`` on can back-propagate through it.
        """
        ids = input_ids.reshape(-1).tolist()
        return self._logits(self._hidden([SeqInput(ids, self.new_kv_cache(len(ids)))]))

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
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim

        hidden = F.embedding(ids, self.model.embed_tokens.weight)
        for index, layer in enumerate(self.model.typed_layers):
            x = rms_norm(hidden, layer.input_layernorm.weight, cfg.rms_norm_eps)
            qkv = layer.self_attn.qkv_proj(x)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = Rotary.apply(q.view(-1, cfg.num_attention_heads, cfg.head_dim), cos, sin)
            k = Rotary.apply(k.view(-1, cfg.num_key_value_heads, cfg.head_dim), cos, sin)
            v = v.view(-1, cfg.num_key_value_heads, cfg.head_dim)
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
            hidden = hidden + layer.self_attn.o_proj(torch.cat(outputs))
            x = rms_norm(hidden, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            gate, up = layer.mlp.gate_up_proj(x).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(F.silu(gate) * up)
        for seq, n in zip(seqs, lengths, strict=True):
            seq.kv.length += n
        return hidden
