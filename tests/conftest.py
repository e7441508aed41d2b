"""Shared fixtures: tiny checkpoints and real ``omni-worker`` processes.

Checkpoints are written once per session. Workers are started through the CLI
(``tests/procs.py``) and shared per module; a module whose tests change worker
state in ways others would notice starts its own through ``worker_factory``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests._router_fixtures import Fleet, make_tiny_checkpoint, start_workers
from tests._tiers import process_fixture
from tests._weight_sync_fixtures import LAYERS, WORKER_ARGS
from tests._worker_helpers import Worker
from tests.procs import ManagedProcess, start_worker

#: Tier markers (unit, inprocess, process, gpu), set from what each test uses; heaviest files first.
pytest_plugins = ["tests._tiers"]

#: The client-compatibility tier (``make test-clients``) runs in its own virtualenv, where the
#: released RL clients are installed; the main suite's environment has none of them.
collect_ignore = [] if importlib.util.find_spec("trl") is not None else ["clients"]
#: The engine tier (``make test-engines``) runs real vLLM servers in its own virtualenv.
if os.environ.get("OMNI_ENGINE_TIER") != "1":
    collect_ignore.append("engines")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``llama`` (seed 0), ``llama_b`` (seed 1, same shapes) and ``qwen2`` (seed 0)."""
    from worker.model import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": write_tiny_checkpoint(root / "llama-seed0", "llama", seed=0),
        "llama_b": write_tiny_checkpoint(root / "llama-seed1", "llama", seed=1),
        "qwen2": write_tiny_checkpoint(root / "qwen2-seed0", "qwen2", seed=0),
    }


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llama`` (seed 0) with ``tokenizer_config.json`` holding the tiny ChatML-style chat template."""
    from worker.model.tiny import TINY_CHAT_TEMPLATE, write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("chat") / "llama-chat", "llama", 0, chat_template=TINY_CHAT_TEMPLATE
    )


@process_fixture(scope="module")
def worker_factory() -> Iterator[Callable[..., Worker]]:
    """Start workers for this module; all are stopped at module teardown."""
    started: list[Worker] = []

    def start(
        model_dir: Path, *args: str, env: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> Worker:
        proc, url = start_worker(model_dir, extra_args=list(args), env=env)
        w = Worker(proc, url, Path(model_dir), headers)
        started.append(w)
        return w

    yield start
    for w in started:
        w.proc.stop()


@process_fixture(scope="module")
def worker(worker_factory: Callable[..., Worker], checkpoints: dict[str, Path]) -> Worker:
    """A plain llama worker shared by the module."""
    return worker_factory(checkpoints["llama"])


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that must be in flight while the test acts."""
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture(scope="module")
def sync_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three tiny checkpoints of one architecture with different weights."""
    from worker.model import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return {
        name: str(write_tiny_checkpoint(root / name, "llama", seed, num_hidden_layers=LAYERS))
        for name, seed in (("a", 1), ("b", 2), ("c", 3))
    }


@process_fixture(scope="module")
def sync_workers(sync_ckpts: dict[str, str]) -> Iterator[list[str]]:
    """Two omni-worker processes serving checkpoint ``a``."""
    procs = []
    try:
        for _ in range(2):
            procs.append(start_worker(sync_ckpts["a"], extra_args=WORKER_ARGS))
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            proc.stop()


@process_fixture(scope="module")
def worker_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Fleet]]:
    """Start ``n`` real workers for this module: ``worker_fleet(n, extra_args=..., seeds=..., hosts=..., model=...)``.

    Tiny checkpoints are made (``omni-worker make-tiny``) once per seed for the module; the workers
    serve ``seeds[0]``'s, or ``model`` when given. ``hosts`` puts worker ``i`` on ``hosts[i]`` (a
    loopback address standing in for a pod IP). Every process started is stopped at module teardown,
    whatever the tests did to it (a killed and restarted ``ManagedProcess`` is still the same one)."""
    root = tmp_path_factory.mktemp("fleet")
    made: dict[int, Path] = {}
    started: list[ManagedProcess] = []

    def checkpoint(seed: int) -> Path:
        if seed not in made:
            made[seed] = make_tiny_checkpoint(root / f"seed-{seed}", seed=seed)
        return made[seed]

    def start(
        n: int,
        *,
        extra_args: Sequence[str] = (),
        seeds: Sequence[int] = (0,),
        hosts: Sequence[str] = (),
        model: Path | None = None,
    ) -> Fleet:
        served = model if model is not None else checkpoint(seeds[0])
        others = [checkpoint(seed) for seed in seeds[1:]]
        pairs = start_workers(served, n, extra_args=extra_args, hosts=hosts)
        started.extend(proc for proc, _ in pairs)
        return Fleet([url for _, url in pairs], [proc for proc, _ in pairs], served, others)

    yield start
    for proc in started:
        proc.stop()
