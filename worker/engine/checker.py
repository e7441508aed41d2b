"""The weights checker: strict per-tensor digests of the live weights.

Digests use :mod:`router.dataplane.digest` over the model's checkpoint-named views
(SHA256 of name, dtype, shape and raw bytes; the per-rank checksum is SHA256
over the sorted ``(name, digest)`` pairs), so a trainer computes the same
numbers from the tensors it sent.

Actions (sglang-omni ``StrictWeightChecker``):

* ``checksum`` — digest every tensor and report the per-rank checksum;
* ``snapshot`` — the same, and remember the digests;
* ``compare`` — digest again and diff against the snapshot
  (``matched`` / ``missing`` / ``unexpected`` / ``changed``); without a snapshot
  it fails with "compare requires snapshot first";
* ``reset_tensors`` — **re-snapshots**, as sglang-omni does. Upstream SGLang
  overwrites every parameter with random data instead; a serving worker that
  scrambles its own weights on an admin call is a footgun, so this follows
  sglang-omni's safe reading.

Digesting runs on the scheduler thread, so inference is blocked until it ends.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from worker.model import rank_checksum, tensor_digest


class CheckerError(ValueError):
    """A checker action that cannot run (e.g. compare before snapshot)."""


class WeightsChecker:
    """Holds the snapshot between calls (one instance per rank)."""

    def __init__(self) -> None:
        self._snapshot: dict[str, str] | None = None

    def run(self, action: str, tensors: Iterable[tuple[str, torch.Tensor]], skip: Iterable[str] = ()) -> dict[str, Any]:
        """Execute ``action`` over ``tensors``; returns the summary fields."""
        if action not in ("checksum", "snapshot", "reset_tensors", "compare"):
            raise CheckerError(f"unknown weights_checker action {action!r}")
        if action == "compare" and self._snapshot is None:
            raise CheckerError("compare requires snapshot first")
        start = time.perf_counter()
        skipped = set(skip)
        digests: dict[str, str] = {}
        metadata: dict[str, dict[str, Any]] = {}
        for name, tensor in _named(tensors, skipped):
            digests[name] = tensor_digest(name, tensor)
            metadata[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        summary: dict[str, Any] = {
            "action": action,
            "tensor_count": len(digests),
            "checksums": digests,
            "tensor_metadata": metadata,
            "per_gpu_checksum": rank_checksum(digests),
        }
        if action in ("snapshot", "reset_tensors"):
            self._snapshot = dict(digests)
        elif action == "compare":
            assert self._snapshot is not None
            # Skipped tensors are left out on both sides, not reported missing.
            summary.update(_diff({n: d for n, d in self._snapshot.items() if n not in skipped}, digests))
        summary["elapsed_s"] = time.perf_counter() - start
        return summary


def _named(tensors: Iterable[tuple[str, torch.Tensor]], skipped: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        if name not in skipped:
            yield name, tensor


def _diff(before: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    matched = sorted(n for n in after if n in before and before[n] == after[n])
    changed = sorted(n for n in after if n in before and before[n] != after[n])
    missing = sorted(n for n in before if n not in after)
    unexpected = sorted(n for n in after if n not in before)
    return {"matched": matched, "missing": missing, "unexpected": unexpected, "changed": changed}


def compare_ok(summary: dict[str, Any]) -> bool:
    return not (summary.get("changed") or summary.get("missing") or summary.get("unexpected"))


def engine_report(rank_data: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's engine-level checker fields over every rank's summary, in rank order:
    ``per_engine_checksum`` (SHA256 over the per-rank checksums) and ``ranks`` (each
    rank's digests and its place in the parallel layout). Empty unless every rank
    produced a checksum (a failed action has none to combine)."""
    rank_sums = [d.get("per_gpu_checksum") for d in rank_data]
    if not rank_sums or not all(rank_sums):
        return {}
    engine = hashlib.sha256()
    for checksum in rank_sums:
        engine.update(str(checksum).encode())
    size = len(rank_data)
    ranks = [
        {
            "checksums": d.get("checksums", {}),
            "per_gpu_checksum": rank_sums[i],
            "full_checksum": d.get("full_checksum"),
            "parallelism_info": [
                {
                    "role": "tp",
                    "tp_rank": i,
                    "tp_size": size,
                    "dp_rank": 0,
                    "dp_size": 1,
                    "pp_rank": 0,
                    "pp_size": 1,
                    "rank": i,
                    "size": size,
                }
            ],
        }
        for i, d in enumerate(rank_data)
    ]
    return {"per_engine_checksum": engine.hexdigest(), "ranks": ranks}
