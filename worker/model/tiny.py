"""Write tiny random Llama / Qwen2 checkpoints (for tests and the demo).

Usage: ``omni-worker make-tiny OUT_DIR [--arch llama|qwen2] [--seed N] [--chat-template]``.
The checkpoint is a real Hugging Face directory: ``config.json`` and
``model.safetensors`` with unfused tensor names. It has no ``tokenizer.json``, so the
worker tokenizes bytes (ids 0..255; 256 and 257 are BOS and EOS and decode to nothing).
With ``chat_template`` (``--chat-template``: :data:`TINY_CHAT_TEMPLATE`) it also gets a
``tokenizer_config.json`` holding that template and its special tokens, as a chat model has.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.model.config import HFConfigJson

BYTE_BOS = 256
BYTE_EOS = 257

#: A small ChatML-style template: turns wrapped in ``<|im_start|>role`` and ``eos_token``; roles other
#: than system, user, assistant and tool are refused through ``raise_exception``. With the byte tokenizer
#: the markers are plain text.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: The special tokens written beside :data:`TINY_CHAT_TEMPLATE` (as a Qwen2 chat checkpoint names them).
TINY_SPECIAL_TOKENS: dict[str, str | None] = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
}

_BASE: HFConfigJson = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
    "bos_token_id": BYTE_BOS,
    "eos_token_id": BYTE_EOS,
    "torch_dtype": "float32",
}

_ARCHS: dict[str, HFConfigJson] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
}


def tiny_config(arch: str = "llama", **overrides: Any) -> HFConfigJson:
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCHS)}")
    return {**_BASE, **_ARCHS[arch], **overrides}


def random_state_dict(config: HFConfigJson, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unfused, checkpoint-named random tensors for ``config``.

    Weights are drawn larger than a trained model's so that greedy decoding has
    clear winners (stable across batch shapes) and different seeds disagree.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qwen = config["model_type"] == "qwen2"

    def rand(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + rand(hidden, std=0.05)

    sd = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd[f"{p}.self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        sd[f"{p}.self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        sd[f"{p}.self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        if qwen:
            sd[f"{p}.self_attn.q_proj.bias"] = rand(heads * head_dim, std=0.05)
            sd[f"{p}.self_attn.k_proj.bias"] = rand(kv_heads * head_dim, std=0.05)
            sd[f"{p}.self_attn.v_proj.bias"] = rand(kv_heads * head_dim, std=0.05)
        sd[f"{p}.self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        sd[f"{p}.mlp.gate_proj.weight"] = rand(inter, hidden)
        sd[f"{p}.mlp.up_proj.weight"] = rand(inter, hidden)
        sd[f"{p}.mlp.down_proj.weight"] = rand(hidden, inter)
        sd[f"{p}.input_layernorm.weight"] = norm()
        sd[f"{p}.post_attention_layernorm.weight"] = norm()
    sd["model.norm.weight"] = norm()
    if not config.get("tie_word_embeddings"):
        sd["lm_head.weight"] = rand(vocab, hidden, std=0.5)
    return sd


def write_checkpoint(out_dir: str | Path, config: HFConfigJson, state_dict: dict[str, torch.Tensor]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def write_tiny_checkpoint(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, *, chat_template: str | None = None, **overrides: Any
) -> Path:
    """Write a tiny random checkpoint of ``arch`` and return its directory; with ``chat_template``, a
    ``tokenizer_config.json`` holding it and :data:`TINY_SPECIAL_TOKENS`."""
    config = tiny_config(arch, **overrides)
    out = write_checkpoint(out_dir, config, random_state_dict(config, seed))
    if chat_template is not None:
        tokenizer_config = {**TINY_SPECIAL_TOKENS, "chat_template": chat_template}
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-worker make-tiny", description="Write a tiny random HF checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(_ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="also write tokenizer_config.json with a small ChatML-style chat template (for /v1/chat/completions)",
    )
    args = parser.parse_args(argv)
    template = TINY_CHAT_TEMPLATE if args.chat_template else None
    path = write_tiny_checkpoint(args.out_dir, args.arch, args.seed, chat_template=template)
    extra = " with a chat template" if template else ""
    print(f"wrote tiny {args.arch} checkpoint (seed {args.seed}){extra} to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
