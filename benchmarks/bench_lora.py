"""LoRA on one real ``omni-worker``: an adapter sync against a full-weight sync, and adapters in a mixed batch.

    .venv/bin/python -m benchmarks.bench_lora                 # about a minute on 2 cores
    .venv/bin/python -m benchmarks.bench_lora --rank 64 --requests 32

The model is a generated checkpoint of about 80 MB (the shape of ``bench_weight_sync_e2e``); the
adapters are random, written in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``)
over every attention and MLP projection. Printed, from one run:

- **sync**: ``/update_weights_from_disk`` of the whole checkpoint against ``/load_lora_adapter`` of one
  adapter under a loaded name (an adapter update), medians of ``--repeats``, and their ratio;
- **mixed batch**: ``--requests`` concurrent ``/generate`` calls of ``--tokens`` greedy tokens each, all on
  the base model, all on one adapter, and spread over four adapters (round robin): output tokens per
  second, and each ÷ the base model's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from demo.launch import http_json, start_worker
from worker.model import write_tiny_checkpoint

SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "head_dim": 128}
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(out: Path, checkpoint: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter of ``rank`` over every projection of ``checkpoint``'s model."""
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {  # (out, in) of each projection
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, modules in MODULES.items():
            for module in modules:
                out_f, in_f = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = [m for modules in MODULES.values() for m in modules]
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out


def timed(url: str, path: str, body: dict[str, Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls that must each answer 200."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        status, answer = http_json("POST", url + path, body, timeout=600)
        times.append(time.perf_counter() - start)
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {answer}")
    return statistics.median(times)


def throughput(url: str, adapters: list[str | None], requests: int, tokens: int) -> float:
    """Output tokens per second of ``requests`` concurrent greedy generations, adapters round robin."""

    def one(i: int) -> int:
        body: dict[str, Any] = {
            "input_ids": [5 + i % 50, 17, 42, 9, 3, 11, 60, 7],
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        }
        adapter = adapters[i % len(adapters)]
        if adapter is not None:
            body["lora_path"] = adapter
        status, answer = http_json("POST", url + "/generate", body, timeout=600)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {answer}")
        return len(answer["output_ids"])

    with ThreadPoolExecutor(max_workers=requests) as pool:
        one(0)  # warm-up
        start = time.perf_counter()
        done = sum(pool.map(one, range(requests)))
        return done / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="omni-bench-lora-") as tmp:
        root = Path(tmp)
        checkpoint = write_tiny_checkpoint(root / "model", "llama", 0, **SHAPE)
        adapters = [write_adapter(root / f"adapter-{i}", checkpoint, args.rank, seed=i) for i in range(4)]
        extra = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank), "--num-threads", "1"]
        proc, url = start_worker(checkpoint, extra_args=extra)
        try:
            ckpt_mb = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 1e6
            lora_mb = (adapters[0] / "adapter_model.safetensors").stat().st_size / 1e6
            print(
                f"# omni-worker, CPU, {os.cpu_count()} cores, python {sys.version.split()[0]}, torch {torch.__version__}"
            )
            print(f"# checkpoint {ckpt_mb:.1f} MB; adapter rank {args.rank}, {lora_mb:.2f} MB, every projection")
            for i, path in enumerate(adapters):
                http_json("POST", url + "/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": str(path)})
            full = timed(url, "/update_weights_from_disk", {"model_path": str(checkpoint)}, args.repeats)
            lora = timed(url, "/load_lora_adapter", {"lora_name": "a0", "lora_path": str(adapters[0])}, args.repeats)
            print("\n## sync, median of", args.repeats)
            print("| sync | seconds |\n|---|---|")
            print(f"| full weights, /update_weights_from_disk | {full:.3f} |")
            print(f"| one adapter, /load_lora_adapter (an update) | {lora:.3f} |")
            print(f"| **adapter ÷ full** | **{lora / full:.3f}** |")
            print(f"\n## mixed batch: {args.requests} concurrent requests x {args.tokens} tokens")
            print("| adapters in the batch | tokens/s | ÷ base |\n|---|---|---|")
            base = throughput(url, [None], args.requests, args.tokens)
            for label, names in (("0 (base)", [None]), ("1", ["a0"]), ("4", ["a0", "a1", "a2", "a3"])):
                rate = base if names == [None] else throughput(url, names, args.requests, args.tokens)
                print(f"| {label} | {rate:.0f} | {rate / base:.2f} |")
        finally:
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
