"""Shared pieces of the weight-sync HTTP tests: checkpoints, workers, a trainer run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ManagedProcess, free_port, http_json

NUM_BUCKETS = 73
#: 8 layers → 75 checkpoint tensors, enough for 73 buckets (one or two tensors each).
LAYERS = 8
TRAINER_EXIT_S = 150  # a hang guard only
#: One torch thread: on a small shared machine, idle OpenMP threads spinning after each
#: forward step starve the gloo transport (see ``omni-worker --num-threads``).
WORKER_ARGS = ["--num-threads", "1"]


def run_trainer(tmp: Path, workers: list[str], *, wait: bool = True, **cfg: Any) -> tuple[dict, ManagedProcess]:
    out = tmp / f"trainer-{free_port()}.json"
    full = {
        "workers": workers,
        "port": free_port(),
        "group": "weight_update_group",
        "timeout_s": 30,
        "num_buckets": NUM_BUCKETS,
        "out": str(out),
        **cfg,
    }
    proc = ManagedProcess("trainer", [sys.executable, "-m", "tests._weight_sync_trainer", json.dumps(full)]).start()
    if wait:
        proc.wait_exit(TRAINER_EXIT_S)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert "crash" not in report, report["crash"]
    return report, proc


def steps(report: dict, name: str) -> list[dict]:
    return [s for s in report.get("steps", []) if s["step"] == name]


def checksum(url: str) -> str:
    status, body = http_json("POST", url + "/weights_checker", {"action": "checksum"})
    assert status == 200, body
    return body["per_gpu_checksum"]


def model_info(url: str) -> dict:
    status, body = http_json("GET", url + "/model_info")
    assert status == 200, body
    return body


PROMPTS = [[1, 2, 3, 4, 5], [72, 101, 108, 108, 111], [200, 17, 3]]


def transformers_greedy(path: str | Path, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from ``transformers`` on the checkpoint at ``path`` (end of
    sequence not honoured, as a worker asked with ``ignore_eos``): the reference a worker must equal."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def greedy(url: str, prompt: list[int], n: int = 12) -> list[int]:
    status, body = http_json(
        "POST",
        url + "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}},
        timeout=60,
    )
    assert status == 200, body
    return body["output_ids"]
