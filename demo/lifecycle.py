"""One demo run from start to exit status: a fleet on a fresh tiny checkpoint, the training, the clean-up.

``python -m demo`` and ``python -m demo --lora`` both run through :func:`run_demo`, so they report failures,
exit with the same statuses and survive a second Ctrl-C alike, and neither can leave a worker behind.
Exit status: 0 when the training verified; 1 on any failure; 130 when interrupted.
"""

from __future__ import annotations

import secrets
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from demo.fleet import Fleet
from demo.trainer import DemoError
from router.trainer import RouterCallError, SyncError
from worker.model import write_tiny_checkpoint

PolicyT = TypeVar("PolicyT")

#: Run once the training is over (``True``: it succeeded), before the fleet stops: a trainer that holds
#: something of the workers' (a weight-update group) lets go of it while they are still up.
Closer = Callable[[bool], None]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_demo(
    *,
    workers: int,
    seed: int,
    tmp_prefix: str,
    build_policy: Callable[[Path], PolicyT],
    train: Callable[[Fleet, PolicyT, list[Closer]], None],
    detailed: type[SyncError] | type[RouterCallError],
    worker_args: Sequence[str] = (),
) -> int:
    """Start ``workers`` omni-workers and a router on a tiny random llama, train, and stop every process.

    ``build_policy(model_dir)`` runs while the workers boot; ``train(fleet, policy, closers)`` runs once
    the router is up and appends to ``closers`` what must be released before the fleet stops. Failures
    of type ``detailed`` are printed with each worker's result. Returns the exit status.
    """
    started = time.perf_counter()
    torch.set_num_threads(1)  # two workers and the trainer share a small machine
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    ok, interrupted = False, False
    closers: list[Closer] = []
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "model", "llama", seed=seed)
        fleet = Fleet(
            model_dir,
            workers=workers,
            admin_key=secrets.token_urlsafe(24),
            state_dir=Path(tmp) / "router-state",
            worker_args=worker_args,
        )
        try:
            flags = f" ({' '.join(worker_args)})" if worker_args else ""
            print(f"starting {workers} omni-workers{flags} and an omni-router on a tiny random llama ({model_dir})")
            fleet.start_workers()
            policy = build_policy(model_dir)  # while the workers boot
            fleet.start_router()
            train(fleet, policy, closers)
            ok = True
        except detailed as exc:
            print(f"\nFAILED: {exc}")
            for r in exc.results:
                print(f"  {r.worker}: success={r.success} status={r.status_code} {r.reason()[:200]}")
        except (DemoError, RuntimeError, TimeoutError, OSError) as exc:
            print(f"\nFAILED: {type(exc).__name__}: {exc}")
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted; stopping every process")
        finally:
            # A second Ctrl-C must not cut the clean-up short and orphan a worker.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                for close in closers:
                    close(ok)
            finally:
                try:
                    _stop(fleet, keep_logs=not (ok or interrupted))
                finally:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.signal(signal.SIGTERM, previous_term)
    print(f"{'done' if ok else 'stopped'} in {time.perf_counter() - started:.1f}s")
    return 0 if ok else 130 if interrupted else 1


def _stop(fleet: Fleet, *, keep_logs: bool) -> None:
    """Stop every process; keep their logs only when they may explain a failure."""
    fleet.stop()
    if keep_logs:
        print("process logs kept: " + " ".join(str(p) for p in fleet.log_paths()))
    else:
        fleet.remove_logs()
