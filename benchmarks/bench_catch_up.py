"""The router's catch-up of a late joiner (registered → routable) vs. a fresh load from local disk.

    python -m benchmarks.bench_catch_up [--hidden 1024] [--layers 4] [--vocab 16000] [--repeats 3]

Writes two random Llama checkpoints of the same shapes, starts three real ``omni-worker``
processes on checkpoint A and an ``omni-router`` (``--sync-joiners peer``, probes every 0.5 s)
over the first two, moves the fleet to checkpoint B through the router, then, alternately:

* ``catch-up``: the third worker (on A) is registered with ``POST /workers`` and timed until
  ``GET /workers/{id}`` shows it routable: the router's first probe, its next scan, the load from a
  peer with every check, the metadata read and the record. It is then deregistered and loaded back
  to A on the worker itself, so the next round starts from a joiner again;
* ``disk``: ``POST /update_weights_from_disk`` of checkpoint B on that worker directly (page cache
  warm: the best case for a disk load), timed request → answer.

Then, with the workers stopped, the trainer's broadcast of the same bytes (checkpoint B's tensors,
same names and shapes) to one receiver process, timed as ``bench_weight_sync`` times it (gloo on
CPU, NCCL on GPUs): one flat broadcast (the transport's ceiling) and the two-phase flattened path a
trainer sync uses, both without HTTP.

Prints each round (with the load alone, as the router logs it), the medians and their ratios
(catch-up ÷ disk, catch-up ÷ the trainer's broadcast).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_peer_load import _cpu_name, model_arguments, write_checkpoints
from demo.launch import ManagedProcess, cli, free_port, http_json, start_worker

KEY = "bench-catch-up-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _call(method: str, url: str, body: Any = None) -> Any:
    status, answer = http_json(method, url, body, headers=HEADERS, timeout=900)
    if status not in (200, 201):
        raise SystemExit(f"{method} {url} failed: {status} {answer}")
    return answer


def _until_routable(router: str, worker_id: str, bound_s: float = 300.0) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        view = _call("GET", f"{router}/workers/{worker_id}")
        if view["health"] == "healthy" and view["pending"] is None:
            return
        time.sleep(0.01)
    raise SystemExit(f"worker {worker_id} not routable within {bound_s:g}s: {view}")


#: safetensors' dtype names → torch's.
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_spec(checkpoint: Path) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of every tensor of a checkpoint, as a trainer would plan them."""
    from safetensors import safe_open

    spec = []
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                view = f.get_slice(name)
                spec.append((name, _DTYPES[view.get_dtype()], list(view.get_shape())))
    return spec


def broadcast_seconds(checkpoint: Path, repeats: int) -> tuple[float, float]:
    """Medians of the trainer's broadcast of ``checkpoint``'s bytes to one receiver: (raw, two-phase flattened)."""
    from benchmarks import bench_weight_sync as ws
    from router.trainer.sender import BucketPlan

    ws.single_threaded_copies()
    plan = BucketPlan.from_spec(checkpoint_spec(checkpoint))
    bench = ws.Bench(argparse.Namespace(receivers=1, backend="auto"))
    raw: list[float] = []
    flat: list[float] = []
    try:
        tensors = ws.tensors_for(plan, bench.device)
        for round_ in range(ws.WARMUP_ROUNDS + repeats):
            r, f = bench.run("raw", plan, tensors), bench.run("flattened_bucket", plan, tensors)
            if round_ >= ws.WARMUP_ROUNDS:
                raw.append(r)
                flat.append(f)
    finally:
        bench.close()
    return statistics.median(raw), statistics.median(flat)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    args = model_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="bench-catch-up-") as tmp:
        a, b, size_mb = write_checkpoints(Path(tmp), args)
        procs: list[ManagedProcess] = []
        try:
            urls = []
            for _ in range(3):
                proc, url = start_worker(a, extra_args=["--admin-api-key", KEY], ready_timeout=300)
                procs.append(proc)
                urls.append(url)
            port = free_port()
            router_argv = [cli("omni-router"), "--port", str(port), "--admin-api-key", KEY]
            router_argv += ["--data-plane-processes", "1", "--health-check-interval-s", "0.5", "--worker-urls"]
            router_proc = ManagedProcess(f"router-{port}", [*router_argv, *urls[:2]]).start()
            procs.append(router_proc)
            router = f"http://127.0.0.1:{port}"
            router_proc.wait_http_ready(router + "/liveness", timeout=60)
            _call("POST", router + "/update_weights_from_disk", {"model_path": str(b), "weight_version": "b"})
            joiner = urls[2]
            catch_up, disk, load = [], [], []
            for round_ in range(args.repeats):
                start = time.perf_counter()
                worker_id = _call("POST", router + "/workers", {"url": joiner})["id"]
                _until_routable(router, worker_id)
                catch_up.append(time.perf_counter() - start)
                _call("DELETE", f"{router}/workers/{worker_id}")
                _call("POST", joiner + "/update_weights_from_disk", {"model_path": str(a), "weight_version": "a"})
                start = time.perf_counter()
                _call("POST", joiner + "/update_weights_from_disk", {"model_path": str(b), "weight_version": "b"})
                disk.append(time.perf_counter() - start)
                _call("POST", joiner + "/update_weights_from_disk", {"model_path": str(a), "weight_version": "a"})
                # The router's own line: the load under the lock, checks and record included.
                load = [float(x) for x in re.findall(r"bytes in ([0-9.]+)s", router_proc.log_text(10_000_000))]
                print(f"round {round_}: catch-up {catch_up[-1]:.2f} s (load {load[-1]:.2f} s), disk {disk[-1]:.2f} s")
        finally:
            for proc in reversed(procs):
                proc.stop()
        raw, flat = broadcast_seconds(b, args.repeats)
    c, d, m = statistics.median(catch_up), statistics.median(disk), statistics.median(load)
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores; checkpoint {size_mb:.0f} MB float32")
    print(f"median: catch-up {c:.2f} s (its load {m:.2f} s), disk {d:.2f} s; catch-up / disk = {c / d:.2f}x")
    print(
        f"trainer broadcast of the same bytes: raw {raw:.2f} s, two-phase flattened {flat:.2f} s; "
        f"catch-up / two-phase = {c / flat:.2f}x, its load / two-phase = {m / flat:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
