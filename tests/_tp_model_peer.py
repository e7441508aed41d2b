"""One tensor-parallel rank of the model tests (no HTTP).

    python -m tests._tp_model_peer CONFIG_JSON

Joins a gloo group on 127.0.0.1 (``port``, ``rank``, ``size``, bounded by
``timeout_s``), then for every checkpoint in ``cases`` builds the sharded model,
loads the full checkpoint, runs :func:`run_case` (the same scenario the test runs
at size 1 for reference) and the checks that need a live group, and saves
everything with ``torch.save`` to ``out`` (``{"crash": traceback}`` on failure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from router.trainer.sender import sent_checksum
from tests._tp_ranks import rank_main
from worker.model import CausalLM, ModelConfig, SeqInput, WeightLoadError, read_checkpoint
from worker.model.tensor_parallel import TensorParallel
from worker.model.tiny import tiny_config

# Configs a size-2 group must refuse at construction, with the number the message names.
BAD_CONFIGS: dict[str, dict[str, int]] = {
    "num_attention_heads=3": {"num_attention_heads": 3, "num_key_value_heads": 1},
    "intermediate_size=127": {"intermediate_size": 127},
    "num_key_value_heads=3": {"num_attention_heads": 6, "num_key_value_heads": 3},
}


def build(path: str | Path, tp: TensorParallel | None = None) -> CausalLM:
    model = CausalLM(ModelConfig.from_dir(path), tp=tp)
    model.load_weights(read_checkpoint(path, torch.float32), require_complete=True)
    return model


def run_case(model: CausalLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Full-sequence logits per prompt, and a greedy decode of all prompts as one
    ragged batch through small, growing KV caches (as the scheduler drives it)."""
    full = [model.forward_full(torch.tensor(p)[None])[0] for p in prompts]
    caches = [model.new_kv_cache(4) for _ in prompts]
    logits = model.forward_batch([SeqInput(list(p), kv) for p, kv in zip(prompts, caches, strict=True)])
    step_logits = [logits]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        for out, t in zip(tokens, nxt, strict=True):
            out.append(t)
        logits = model.forward_batch([SeqInput([t], kv) for t, kv in zip(nxt, caches, strict=True)])
        step_logits.append(logits)
    return {
        "full_logits": full,
        "tokens": tokens,
        "step_logits": torch.stack(step_logits),
        "kv_heads": caches[0].keys.shape[1],
    }


def _param_digest(model: CausalLM) -> str:
    return sent_checksum((n, p.detach()) for n, p in model.named_parameters())


def group_checks(model: CausalLM, path: str, tp: TensorParallel) -> dict[str, Any]:
    """What needs this rank's shards or the live group."""
    checkpoint = dict(read_checkpoint(path, torch.float32))
    specs = model.shard_specs()
    shards = {name: view.clone() for name, view in model.iter_checkpoint_tensors()}
    # The leader's path to a trainer-comparable checksum: gather every rank's shard, rebuild, digest.
    rebuilt = ((name, specs[name].full_tensor(tp.all_gather(view))) for name, view in model.iter_checkpoint_tensors())
    gathered_checksum = sent_checksum(rebuilt)

    before = _param_digest(model)
    q_name = "model.layers.1.self_attn.q_proj.weight"
    refusals = {}
    wrong = [
        ("model.layers.0.mlp.down_proj.weight", checkpoint["model.layers.0.mlp.down_proj.weight"] * 2),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(7, model.config.hidden_size)),
    ]
    for label, named in {
        "wrong_shape": wrong,
        "local_shape": [(q_name, shards[q_name])],  # this rank's shard is not a full tensor
    }.items():
        for call in (model.validate_weights, model.load_weights):
            try:
                call(named)
                refusals[f"{label}/{call.__name__}"] = ""
            except WeightLoadError as exc:
                refusals[f"{label}/{call.__name__}"] = str(exc)
    unchanged = _param_digest(model) == before

    for p in model.parameters():
        p.requires_grad_(True)
    try:
        model.forward_logits(torch.tensor([1, 2, 3]))
        grad_refusal = ""
    except NotImplementedError as exc:
        grad_refusal = str(exc)
    for p in model.parameters():
        p.requires_grad_(False)

    return {
        "shards": shards,
        "specs": {name: (s.dim, s.size, s.replicas) for name, s in specs.items()},
        "checkpoint_spec": {name: (str(d), tuple(s)) for name, (d, s) in model.checkpoint_spec().items()},
        "gathered_checksum": gathered_checksum,
        "refusals": refusals,
        "unchanged": unchanged,
        "grad_refusal": grad_refusal,
        "param_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
    }


def bad_config_errors(tp: TensorParallel) -> dict[str, str]:
    errors = {}
    for label, overrides in BAD_CONFIGS.items():
        try:
            CausalLM(ModelConfig.from_dict(tiny_config("llama", **overrides)), tp=tp)
            errors[label] = ""
        except ValueError as exc:
            errors[label] = str(exc)
    return errors


def run(tp: TensorParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"bad_configs": bad_config_errors(tp), "cases": {}}
    for name, path in cfg["cases"].items():
        model = build(path, tp)
        case = run_case(model, cfg["prompts"], cfg["steps"])
        case.update(group_checks(model, path, tp))
        report["cases"][name] = case
    return report


if __name__ == "__main__":
    rank_main(run)
