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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from router.contract.admin import CheckerRank
from worker.engine.results import CheckerDiff, CheckerReport, TensorMeta
from worker.model import rank_checksum, tensor_digest

ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")


class CheckerError(ValueError):
    """A checker action that cannot run (e.g. compare before snapshot)."""


class WeightsChecker:
    """Holds the snapshot between calls (one instance per rank)."""

    def __init__(self) -> None:
        self._snapshot: dict[str, str] | None = None

    def run(self, action: str, tensors: Iterable[tuple[str, torch.Tensor]], skip: Iterable[str] = ()) -> CheckerReport:
        """Execute ``action`` over ``tensors``; returns this rank's summary."""
        if action not in ACTIONS:
            raise CheckerError(f"unknown weights_checker action {action!r}")
        if action == "compare" and self._snapshot is None:
            raise CheckerError("compare requires snapshot first")
        start = time.perf_counter()
        skipped = set(skip)
        digests: dict[str, str] = {}
        metadata: dict[str, TensorMeta] = {}
        for name, tensor in _named(tensors, skipped):
            digests[name] = tensor_digest(name, tensor)
            metadata[name] = TensorMeta(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        checksum = rank_checksum(digests)
        diff = None
        if action in ("snapshot", "reset_tensors"):
            self._snapshot = dict(digests)
        elif action == "compare":
            assert self._snapshot is not None
            # Skipped tensors are left out on both sides, not reported missing.
            diff = _diff({n: d for n, d in self._snapshot.items() if n not in skipped}, digests)
        return CheckerReport(
            action,
            checksums=digests,
            tensor_metadata=metadata,
            per_gpu_checksum=checksum,
            diff=diff,
            elapsed_s=time.perf_counter() - start,
        )


def _named(tensors: Iterable[tuple[str, torch.Tensor]], skipped: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        if name not in skipped:
            yield name, tensor


def _diff(before: dict[str, str], after: dict[str, str]) -> CheckerDiff:
    return CheckerDiff(
        matched=sorted(n for n in after if n in before and before[n] == after[n]),
        missing=sorted(n for n in before if n not in after),
        unexpected=sorted(n for n in after if n not in before),
        changed=sorted(n for n in after if n in before and before[n] != after[n]),
    )


@dataclass(frozen=True, slots=True)
class EngineReport:
    """SGLang's engine-level checker fields over every rank's summary, in rank order."""

    per_engine_checksum: str
    """SHA256 over the per-rank checksums."""
    ranks: list[CheckerRank]
    """Each rank's digests and its place in the parallel layout."""


def engine_report(reports: Sequence[CheckerReport | None]) -> EngineReport | None:
    """The engine-level report over every rank's summary; None unless every rank produced a
    checksum (a failed action has none to combine)."""
    rank_sums = [r.per_gpu_checksum if r is not None else None for r in reports]
    if not rank_sums or not all(rank_sums):
        return None
    engine = hashlib.sha256()
    for checksum in rank_sums:
        engine.update(str(checksum).encode())
    size = len(reports)
    ranks = [
        CheckerRank(
            checksums=dict(r.checksums),
            per_gpu_checksum=r.per_gpu_checksum,
            full_checksum=r.full_checksum,
            parallelism_info=[
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
        )
        for i, r in enumerate(reports)
        if r is not None and r.per_gpu_checksum is not None
    ]
    return EngineReport(engine.hexdigest(), ranks)
