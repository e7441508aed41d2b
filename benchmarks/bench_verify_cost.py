"""What proving an update costs, per engine: an expected digest, and ``--verify-updates changed``.

    .venv/bin/python -m benchmarks.bench_verify_cost                         # omni-worker
    .venv-engines/bin/python -m benchmarks.bench_verify_cost --engines omni vllm

One real server per engine (omni-worker; vLLM's CPU build where this interpreter has it) behind a real
``omni-router``, updated from disk again and again, alternating two random checkpoints of the same
shape (a Llama of ``--hidden`` × ``--layers``, float32, written by ``transformers``). SGLang has no CPU
server: for it, one digest's hashing (its own code, in-process) is timed instead. Each update runs in
three modes, each its own router in front of the same server:

- ``off``: ``--verify-updates off`` and no header: the router reads each target's version back, no digest;
- ``digest``: the trainer's digest of the checkpoint sent (``X-Expected-Weights-Checksum``,
  ``router.trainer.digests.expected_checksum``): one read of the engine's digest after the update;
- ``changed``: ``--verify-updates changed``: the engine's digest read before and after.

An omni-worker updates with ``/update_weights_from_disk``; vLLM with ``/collective_rpc reload_weights``
between ``/pause?mode=keep`` and ``/resume`` (only the reload is timed). Printed: one JSON line per
update (``--json-steps``), then per engine and mode the p50 of the update's total and of its
``verification`` phase (the answer's ``timings``), what each mode's verification adds to ``off``'s (the
digest reads: the modes differ in nothing else), that as a fraction of ``off``'s whole update, and the
checkpoint's megabytes per second of one digest read. vLLM's CPU build repacks its projections and hashes zero bytes for them
(docs/weight-sync.md), so its digest covers the embeddings, the norms and ``lm_head``: its cost is that.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.peer_tools import machine_line
from demo.launch import ManagedProcess, http_json, start_worker
from router.contract.weight_digest import EXPECTED_CHECKSUM_HEADER
from router.trainer.digests import DigestEngine, expected_checksum
from tests._router_fixtures import start_router
from worker.model.checkpoint import read_checkpoint

MODES = ("off", "digest", "changed")
#: How many times each mode reads every target's digest per update.
READS = {"off": 0, "digest": 1, "changed": 2}
#: One update's bound (a reload of a large checkpoint, hashed twice, on 2 cores).
CALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Engine:
    """How to start one engine's server and update it from a checkpoint directory."""

    name: DigestEngine
    start: Callable[[Path], tuple[ManagedProcess, str]]
    update: Callable[[str, Path, dict[str, str]], tuple[int, Any]]
    digest: Callable[[Path], str]


def write_llama(out: Path, seed: int, hidden: int, layers: int) -> Path:
    """A random float32 Llama (``config.json``, ``model.safetensors``, a byte tokenizer) that both engines load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.engines._checkpoints import CONFIG, write_tokenizer

    shape = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers}
    heads = hidden // 64
    config = {
        **CONFIG,
        **shape,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
    }
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32")).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def omni_engine() -> Engine:
    def update(router: str, path: Path, headers: dict[str, str]) -> tuple[int, Any]:
        body = {"model_path": str(path)}
        return http_json("POST", router + "/update_weights_from_disk", body, headers=headers, timeout=CALL_TIMEOUT_S)

    return Engine(
        "omni",
        lambda path: start_worker(path, ready_timeout=300),
        update,
        lambda path: expected_checksum(read_checkpoint(path, torch.float32), "omni"),
    )


def vllm_engine() -> Engine:
    from tests.engines._vllm_server import PLUGIN_ARGS, start_vllm, wait_ready

    def start(path: Path) -> tuple[ManagedProcess, str]:
        server = start_vllm(path, extra_args=PLUGIN_ARGS)
        wait_ready([server])
        return server.proc, server.url

    def update(router: str, path: Path, headers: dict[str, str]) -> tuple[int, Any]:
        http_json("POST", router + "/pause?mode=keep", timeout=60)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        try:
            return http_json("POST", router + "/collective_rpc", rpc, headers=headers, timeout=CALL_TIMEOUT_S)
        finally:
            http_json("POST", router + "/resume", timeout=60)

    return Engine(
        "vllm",
        start,
        update,
        lambda path: expected_checksum(read_checkpoint(path, torch.float32), "vllm", vllm_cpu=True),
    )


ENGINES = {"omni": omni_engine, "vllm": vllm_engine}


def sglang_hashing_ms(path: Path, repeats: int) -> float:
    """The p50 milliseconds of one digest by SGLang's checker on its CPU path, SGLang's own ``tensor_hash`` and
    ``overall_checksum`` called in-process over the checkpoint's tensors (SGLang has no CPU server to read it
    from; on a GPU it hashes with a Triton kernel instead)."""
    from tests.engines import sglang_standin  # SGLang's modules, imported behind the stand-in's torchvision stub

    tensors = list(read_checkpoint(path, torch.float32))
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        sglang_standin.overall_checksum({name: f"{sglang_standin.tensor_hash(t):016x}" for name, t in tensors})
        runs.append((time.perf_counter() - started) * 1000)
    return statistics.median(runs)


@contextmanager
def router_for(url: str, mode: str) -> Iterator[str]:
    flag = "changed" if mode == "changed" else "off"
    proc, router = start_router([url], extra_args=["--verify-updates", flag])
    try:
        yield router
    finally:
        proc.stop()


def run_engine(engine: Engine, ckpts: list[Path], updates: int, json_steps: bool) -> dict[str, dict[str, float]]:
    """Every mode's updates on one server; per mode the p50 of total and verification (ms)."""
    digests = {path: engine.digest(path) for path in ckpts}
    proc, url = engine.start(ckpts[0])
    summary: dict[str, dict[str, float]] = {}
    try:
        for mode in MODES:
            totals: list[float] = []
            checks: list[float] = []
            with router_for(url, mode) as router:
                for step in range(updates + 1):  # the first is a warm-up, not counted
                    path = ckpts[(step + 1) % len(ckpts)]
                    headers = {EXPECTED_CHECKSUM_HEADER: digests[path]} if mode == "digest" else {}
                    started = time.perf_counter()
                    status, answer = engine.update(router, path, headers)
                    wall_ms = (time.perf_counter() - started) * 1000
                    if status != 200:
                        raise RuntimeError(f"{engine.name} {mode}: {status} {answer}")
                    timings = answer["timings"]
                    if json_steps:
                        line = {"engine": engine.name, "mode": mode, "step": step, "wall_ms": round(wall_ms, 1)}
                        print(json.dumps({**line, "timings": timings}), flush=True)
                    if step:
                        totals.append(timings["total"])
                        checks.append(timings.get("verification", 0.0))
            summary[mode] = {"total": statistics.median(totals), "verification": statistics.median(checks)}
    finally:
        proc.stop()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=[*sorted(ENGINES), "sglang"], default=["omni"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--updates", type=int, default=5, help="counted updates per mode (after one warm-up)")
    parser.add_argument("--json-steps", action="store_true")
    args = parser.parse_args()
    for needs in ("vllm", "sglang"):
        if needs in args.engines and importlib.util.find_spec(needs) is None:
            parser.error(f"{needs} is not installed in this interpreter (run it with .venv-engines/bin/python)")
    print(machine_line())
    root = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    ckpts = [write_llama(root / f"step{seed}", seed, args.hidden, args.layers) for seed in (1, 2)]
    weights_mb = sum(t.numel() * t.element_size() for _, t in read_checkpoint(ckpts[0], torch.float32)) / 1e6
    print(f"checkpoint: Llama hidden {args.hidden}, {args.layers} layers, float32, {weights_mb:.0f} MB")
    print(
        "| engine | mode | update p50 (ms) | verification p50 (ms) | added to off (ms) | added ÷ update | MB/s per read |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.engines:
        if name == "sglang":
            ms = sglang_hashing_ms(ckpts[0], args.updates)
            print(
                f"| sglang | one digest, hashing only (SGLang's code in-process) | - | {ms:.0f} | - | - | "
                f"{weights_mb / (ms / 1000):.0f} |",
                flush=True,
            )
            continue
        summary = run_engine(ENGINES[name](), ckpts, args.updates, args.json_steps)
        off = summary["off"]
        for mode in MODES:
            row = summary[mode]
            # The modes differ in their digest reads only: what each adds is its verification phase's excess.
            added = row["verification"] - off["verification"]
            reads = READS[mode]
            rate = f"{weights_mb / (max(added, 1e-3) / 1000 / reads):.0f}" if reads else "-"
            print(
                f"| {name} | {mode} | {row['total']:.0f} | {row['verification']:.0f} | {added:+.0f} | "
                f"{added / off['total']:+.2f} | {rate} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
