"""Model hyper-parameters read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A ``config.json`` as Hugging Face writes it: its keys and their types are transformers' to define
#: (and grow with every release), so it is read field by field, each checked where it is used.
HFConfigJson = dict[str, Any]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


class ModelConfigError(ValueError):
    """The config names an architecture or feature this worker cannot serve."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The subset of a Llama / Qwen2 config that determines tensors and math."""

    architecture: str
    """``"llama"`` or ``"qwen2"``."""
    hf_architecture: str
    """The class name as written in ``config.json`` (``LlamaForCausalLM``...)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections: always for Qwen2, ``attention_bias`` for Llama."""
    o_bias: bool
    """Bias on the output projection (Llama's ``attention_bias`` only)."""
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: HFConfigJson = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        try:
            data = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"no config.json in {path}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read {config_path}: {exc}") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{config_path} is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: HFConfigJson) -> ModelConfig:
        archs = data.get("architectures") or []
        hf_arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if hf_arch is None:
            raise ModelConfigError(f"unsupported architectures {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        arch = SUPPORTED_ARCHITECTURES[hf_arch]
        try:
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
            kv_heads = int(data.get("num_key_value_heads") or heads)
            head_dim = int(data.get("head_dim") or hidden // heads)
            vocab = int(data["vocab_size"])
            intermediate = int(data["intermediate_size"])
            layers = int(data["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"config.json is missing or has a bad field: {exc}") from None
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if data.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        if data.get("use_sliding_window"):
            raise ModelConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        if data.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={data.get('hidden_act')!r} is not supported (only silu)")

        rope_theta, rope_type = _rope_settings(data)
        if rope_type not in (None, "default"):
            raise ModelConfigError(f"rope type {rope_type!r} is not supported (only default RoPE)")

        attention_bias = bool(data.get("attention_bias", False))
        eos = data.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        return cls(
            architecture=arch,
            hf_architecture=hf_arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch == "llama" and attention_bias,
            eos_token_ids=eos_ids,
            bos_token_id=data.get("bos_token_id"),
            raw=data,
        )


def _rope_settings(data: HFConfigJson) -> tuple[float, str | None]:
    """RoPE base and type, from either the classic fields or ``rope_parameters``
    (the layout newer ``transformers`` releases write)."""
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling") or {}
    theta = data.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type")
    return float(theta), rope_type
