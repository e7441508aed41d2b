"""Run one test scenario on every rank of a tensor-parallel group: ``size`` real processes of a peer
module (``python -m tests._tp_*_peer``), each writing its report to a file the test reads back
(:func:`run_ranks` in the test, :func:`rank_main` in the peer)."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from tests.procs import ManagedProcess, free_port
from worker.model.tensor_parallel import TensorParallel


def run_ranks(
    module: str, label: str, size: int, cfg: dict[str, Any], tmp: Path, *, exit_timeout_s: float
) -> list[dict[str, Any]]:
    """Each rank's report, in rank order. ``cfg`` is what every rank gets; each also gets its ``rank``, the
    group's ``size``, one rendezvous ``port`` and its report's path ``out``. A rank that hangs, writes no
    report or reports a crash fails the test with its log."""
    port = free_port()
    procs: list[tuple[ManagedProcess, Path]] = []
    try:
        for rank in range(size):
            out = tmp / f"rank{rank}.pt"
            arg = json.dumps({**cfg, "rank": rank, "size": size, "port": port, "out": str(out)})
            procs.append((ManagedProcess(f"{label}-rank{rank}", [sys.executable, "-m", module, arg]).start(), out))
        reports = []
        for proc, out in procs:
            proc.wait_exit(exit_timeout_s)
            if not out.exists():
                pytest.fail(f"{proc.name} wrote no report:\n{proc.log_text()}")
            report: dict[str, Any] = torch.load(out, weights_only=True)
            assert "crash" not in report, f"{proc.name}: {report['crash']}"
            reports.append(report)
        return reports
    finally:
        for proc, _ in procs:
            proc.kill()


def rank_main(run: Callable[[TensorParallel, dict[str, Any]], dict[str, Any]]) -> NoReturn:
    """The ``__main__`` of a peer module: join the gloo group ``sys.argv[1]`` names (bounded by its
    ``timeout_s``), ``run`` the scenario on this rank, save its report (``{"crash": traceback}`` on a
    failure) to ``out`` and exit (1 on a crash)."""
    config = json.loads(sys.argv[1])
    try:
        result = _in_group(run, config)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    torch.save(result, config["out"])
    sys.exit(1 if "crash" in result else 0)


def _in_group(run: Callable[[TensorParallel, dict[str, Any]], dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the test machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=cfg["rank"],
        world_size=cfg["size"],
        timeout=timedelta(seconds=cfg["timeout_s"]),
    )
    try:
        assert dist.group.WORLD is not None
        report = run(TensorParallel.from_group(dist.group.WORLD), cfg)
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()
