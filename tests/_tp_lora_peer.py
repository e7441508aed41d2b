"""One tensor-parallel rank of the LoRA tests (no HTTP).

    python -m tests._tp_lora_peer CONFIG_JSON

Joins a gloo group on 127.0.0.1 (``port``, ``rank``, ``size``, bounded by
``timeout_s``), then for every case (a checkpoint and PEFT adapter directories)
builds the sharded model, loads the adapters and runs :func:`run_lora_case`
(the scenario the test also runs at size 1), and saves the results with
``torch.save`` to ``out`` (``{"crash": traceback}`` on failure).
"""

from __future__ import annotations

from typing import Any

import torch

from tests._lora_helpers import greedy_batch
from tests._tp_model_peer import build
from tests._tp_ranks import rank_main
from worker.model import CausalLM, LoadedLora, LoraAdapter, LoraAdapters
from worker.model.tensor_parallel import TensorParallel


def run_lora_case(
    model: CausalLM, adapter_dirs: dict[str, str], prompts: list[list[int]], steps: int
) -> dict[str, Any]:
    """Full-sequence logits of every prompt under every adapter, and a greedy decode of one batch mixing
    the base model and every adapter (each adapter's sequences apart, so its rows are gathered)."""
    registry = LoraAdapters(model, max_loras=len(adapter_dirs), max_lora_rank=16)
    loaded = {label: registry.load(label, LoraAdapter.from_dir(path)) for label, path in adapter_dirs.items()}
    full = {
        label: [model.forward_full(torch.tensor(p), adapter)[0] for p in prompts] for label, adapter in loaded.items()
    }
    choices: list[LoadedLora | None] = [None, *loaded.values()]
    batch_prompts = [p for p in prompts for _ in choices]
    batch_adapters = [a for _ in prompts for a in choices]
    tokens, step_logits = greedy_batch(model, batch_prompts, batch_adapters, steps)
    return {"full_logits": full, "tokens": tokens, "step_logits": step_logits}


def run(tp: TensorParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"cases": {}}
    for name, case in cfg["cases"].items():
        model = build(case["checkpoint"], tp)
        report["cases"][name] = run_lora_case(model, case["adapters"], cfg["prompts"], cfg["steps"])
    return report


if __name__ == "__main__":
    rank_main(run)
