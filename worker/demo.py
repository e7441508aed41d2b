"""The main job: a real worker, a generation, a weight update from disk, a generation again.

Run with ``make demo`` (or ``python -m worker.demo``). Two tiny random
checkpoints stand in for "the policy before" and "the policy after a training
step"; the round shows the output and ``weight_version`` change, and the
weights checker confirm the new weights are exactly those on disk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from router.launch import http_json, start_worker
from worker.model import digest_named_tensors, read_checkpoint, write_tiny_checkpoint
from worker.model.config import ModelConfig

PROMPT = "The policy says:"


def _generate(url: str) -> dict:
    status, body = http_json(
        "POST",
        url + "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}},
    )
    if status != 200:
        raise RuntimeError(f"/generate failed: {status} {body}")
    return body


def _show(label: str, out: dict) -> None:
    meta = out["meta_info"]
    print(f"  {label}: output_ids={out['output_ids']}")
    print(f"  {' ' * len(label)}  weight_version={meta['weight_version']!r} finish={meta['finish_reason']}")


def _expected_checksum(path: Path) -> str:
    """The checksum a worker must report once it holds exactly this checkpoint."""
    import torch

    from worker.model import CausalLM

    model = CausalLM(ModelConfig.from_dir(path), dtype=torch.float32)
    model.load_weights(read_checkpoint(path, torch.float32), require_complete=True)
    return digest_named_tensors(model.iter_checkpoint_tensors())[1]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="omni-demo-") as tmp:
        before = write_tiny_checkpoint(Path(tmp) / "step-0", "llama", seed=0)
        after = write_tiny_checkpoint(Path(tmp) / "step-1", "llama", seed=1)
        print(f"tiny checkpoints: {before} and {after}")
        proc, url = start_worker(before)
        try:
            print(f"omni-worker serving {before.name} at {url}")
            first = _generate(url)
            _show("before update", first)

            status, body = http_json(
                "POST", url + "/update_weights_from_disk", {"model_path": str(after), "weight_version": "step-1"}, timeout=300
            )
            print(f"  update_weights_from_disk -> {status} {body}")
            if status != 200:
                return 1

            second = _generate(url)
            _show("after update ", second)
            _, checker = http_json("POST", url + "/weights_checker", {"action": "checksum"})
            expected = _expected_checksum(after)
            worker_sum = checker["per_gpu_checksum"]
            print(f"  worker checksum {str(worker_sum)[:16]}…, checkpoint checksum {expected[:16]}…")
            changed = first["output_ids"] != second["output_ids"]
            matches = worker_sum == expected
            print(f"output changed: {changed}; weight_version: {second['meta_info']['weight_version']}; checksum matches: {matches}")
            return 0 if changed and matches else 1
        finally:
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
