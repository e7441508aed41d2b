"""LoRA adapters made by PEFT itself on the tiny checkpoints, and the transformers + PEFT reference.

Adapters are created with ``init_lora_weights=False`` (``lora_B`` random, not zero), so every
adapter changes the model's outputs, and saved with PEFT's ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from worker.model import CausalLM, LoadedLora, SeqInput

#: Adapters the tests make, by label: PEFT ``LoraConfig`` arguments and the seed of their random weights.
ADAPTERS: dict[str, dict[str, Any]] = {
    "plain": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "seed": 11,
    },
    "rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear", "seed": 12},
    "partial": {"r": 6, "lora_alpha": 12, "target_modules": ["v_proj", "down_proj"], "seed": 13},
    "attn": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"], "seed": 14},
}


def hf_model(checkpoint: Path) -> Any:
    """The checkpoint in transformers' own implementation, float32, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def peft_model(checkpoint: Path, label: str, **overrides: Any) -> Any:
    """A PEFT LoRA model over ``checkpoint`` with the random adapter ``ADAPTERS[label]`` (``overrides`` on top)."""
    import peft

    spec = {**ADAPTERS[label], **overrides}
    torch.manual_seed(spec.pop("seed"))
    config = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **spec)
    return peft.get_peft_model(hf_model(checkpoint), config).eval()


def write_adapter(checkpoint: Path, label: str, out: Path, **overrides: Any) -> tuple[Path, Any]:
    """Save ``peft_model(checkpoint, label)`` to ``out`` (PEFT's own format); returns ``out`` and the model."""
    model = peft_model(checkpoint, label, **overrides)
    model.save_pretrained(str(out))
    return out, model


def edit_config(adapter_dir: Path, **fields: Any) -> Path:
    """Rewrite fields of ``adapter_dir``'s ``adapter_config.json``."""
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return adapter_dir


def reference_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[T, vocab]`` of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens from full forwards of transformers' model (no cache: nothing of ours is shared)."""
    ids = list(ids)
    out = []
    for _ in range(steps):
        token = int(reference_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def greedy_batch(
    model: CausalLM, prompts: list[list[int]], adapters: list[LoadedLora | None], steps: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill every prompt with its adapter in one ragged batch, then decode ``steps`` greedy tokens
    together through small, growing KV caches (as the scheduler drives it). Returns the tokens per
    prompt and the logits of every step, ``[steps + 1, len(prompts), vocab]``."""
    caches = [model.new_kv_cache(4) for _ in prompts]
    logits = model.forward_batch([SeqInput(list(p), kv, a) for p, kv, a in zip(prompts, caches, adapters, strict=True)])
    step_logits = [logits]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        chosen = logits.argmax(-1).tolist()
        for out, t in zip(tokens, chosen, strict=True):
            out.append(t)
        logits = model.forward_batch([SeqInput([t], kv, a) for t, kv, a in zip(chosen, caches, adapters, strict=True)])
        step_logits.append(logits)
    return tokens, torch.stack(step_logits)
