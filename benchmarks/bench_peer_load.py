"""Catch-up from a live peer vs. a fresh load from local disk, on one machine.

    python -m benchmarks.bench_peer_load [--hidden 1024] [--layers 4] [--vocab 16000] [--repeats 3]

Writes two random Llama checkpoints of the same shapes (about 330 MB of float32 with the
defaults), starts two real ``omni-worker`` processes on checkpoint A, moves the source to
checkpoint B, then times on the sink, alternately:

* ``disk``: ``POST /update_weights_from_disk`` of checkpoint B (the page cache is warm after
  the first round, so this is the best case for a disk load);
* ``peer``: ``POST /update_weights_from_peer`` from the source (which serves B), each
  verified by checksum, preceded by a disk load of A so every peer load really changes the weights.

Prints each round, the medians and their ratio (peer ÷ disk). Both paths end in the same
atomic write; they differ in how the bytes are staged: a checkpoint read, or the source's
digest pass plus one HTTP stream (the sink digests what it received before writing).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from demo.launch import http_json, start_worker
from worker.model import write_tiny_checkpoint

KEY = "bench-peer-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, path: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    status, answer = http_json("POST", url + path, body, headers=HEADERS, timeout=900)
    elapsed = time.perf_counter() - start
    if status != 200:
        raise SystemExit(f"{path} failed: {status} {answer}")
    return elapsed, answer


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def model_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The benchmark model's shape (a random Llama) and the repeat count, parsed."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def write_checkpoints(root: Path, args: argparse.Namespace) -> tuple[Path, Path, float]:
    """Two random Llama checkpoints ``a`` and ``b`` of the same shapes under ``root``, and ``b``'s size in MB."""
    shapes = {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "vocab_size": args.vocab,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    }
    a = write_tiny_checkpoint(root / "a", "llama", 0, **shapes)
    b = write_tiny_checkpoint(root / "b", "llama", 1, **shapes)
    return a, b, sum(f.stat().st_size for f in b.glob("*.safetensors")) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    args = model_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        a, b, size_mb = write_checkpoints(Path(tmp), args)
        procs = []
        try:
            for _ in range(2):
                procs.append(start_worker(a, extra_args=["--admin-api-key", KEY], ready_timeout=300))
            (_, source), (_, sink) = procs
            _post(source, "/update_weights_from_disk", {"model_path": str(b), "weight_version": "b"})
            disk, peer = [], []
            for round_ in range(args.repeats):
                elapsed, _ = _post(sink, "/update_weights_from_disk", {"model_path": str(b), "weight_version": "b"})
                disk.append(elapsed)
                _post(sink, "/update_weights_from_disk", {"model_path": str(a), "weight_version": "a"})
                elapsed, answer = _post(
                    sink, "/update_weights_from_peer", {"source_url": source, "weight_version": "b"}
                )
                assert answer["weights"] == "updated" and answer["checksum"], answer
                peer.append(elapsed)
                print(f"round {round_}: disk {disk[-1]:.2f} s, peer {peer[-1]:.2f} s")
        finally:
            for proc, _ in procs:
                proc.stop()
    d, p = statistics.median(disk), statistics.median(peer)
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores; checkpoint {size_mb:.0f} MB float32")
    print(f"median: disk {d:.2f} s, peer {p:.2f} s; peer / disk = {p / d:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
