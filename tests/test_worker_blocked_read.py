"""A checkpoint read can never freeze a worker.

A checkpoint file that is not a regular file (a FIFO, a device, a socket, a
directory, a ``/proc`` file) is refused with 400 before anything is read. A read
that passes those checks and then blocks in the kernel (a hung network mount)
stalls only its own daemon thread: ``/health``, inference and other admin calls
go on, the update answers at its bound, and SIGTERM still ends the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from router.contract.admin import UpdateWeightsFromDiskRequest
from tests._polling import until, wait_for
from tests.procs import ManagedProcess, free_port, http_json
from worker.coordinator import Coordinator
from worker.engine.daemon_thread import Abandoned, abandon_pending, run_on_daemon_thread
from worker.engine.model_worker import ModelWorker
from worker.engine.scheduler import Scheduler
from worker.model import WeightLoadError, load_model, read_checkpoint, shard_io
from worker.model.checkpoint import read_checkpoint_chunked
from worker.ranks import AdminBusy, AdminTimeout, Stage

# -- helpers ---------------------------------------------------------------------------------


def _bounded(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """``fn()`` on a daemon thread, failing the test instead of hanging if it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} still blocked after {timeout}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _release_fifo_reader(fifo: Path) -> None:
    """Let a thread blocked opening ``fifo`` for reading go on (a writer appears and leaves)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is blocked on it (any more)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def special(tmp_path: Path, checkpoints: dict[str, Path]) -> Iterator[dict[str, tuple[Path, str, str]]]:
    """Checkpoints with one file that is not a regular file: ``label: (dir, file, what the refusal must say)``."""
    out: dict[str, tuple[Path, str, str]] = {}

    def variant(label: str, file: str, make: Callable[[Path], None], kind: str) -> None:
        root = _copy(checkpoints["llama"], tmp_path / label)
        (root / file).unlink(missing_ok=True)
        make(root / file)
        out[label] = (root, file, kind)

    variant("fifo", "model.safetensors", os.mkfifo, "fifo")
    variant("dev-zero", "model.safetensors", lambda p: p.symlink_to("/dev/zero"), "character device")
    variant("proc", "model.safetensors", lambda p: p.symlink_to("/proc/version"), "size 0")
    variant("directory", "model.safetensors", lambda p: p.mkdir(), "directory")
    variant("empty", "model.safetensors", lambda p: p.write_bytes(b""), "size 0")
    variant("config-fifo", "config.json", os.mkfifo, "fifo")
    variant("config-proc", "config.json", lambda p: p.symlink_to("/proc/version"), "size 0")
    variant("index-fifo", "model.safetensors.index.json", os.mkfifo, "fifo")
    # A socket's path must be short (about 100 bytes): bind it in a short directory and link to it.
    sock_dir = Path(tempfile.mkdtemp(prefix="omni-sock-"))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_dir / "s"))  # the socket file outlives the socket
    variant("socket", "model.safetensors", lambda p: p.symlink_to(sock_dir / "s"), "socket")
    yield out
    shutil.rmtree(sock_dir, ignore_errors=True)


# -- in-process: the checks and the reader ---------------------------------------------------------


def test_files_that_are_not_regular_are_refused_before_reading(special):
    for label, (root, file, kind) in special.items():
        readers: dict[str, Callable[[], Any]] = {"start-up load": lambda r=root: load_model(r)}
        if file != "config.json":  # only the start-up load reads config.json here
            readers["chunked read"] = lambda r=root: read_checkpoint_chunked(r, torch.float32)
            readers["memory-mapped read"] = lambda r=root: list(read_checkpoint(r, torch.float32))
        for reader, read in readers.items():
            with pytest.raises(WeightLoadError) as info:
                _bounded(read)
            message = str(info.value).lower()
            assert file in message and kind in message, (label, reader, message)


def test_chunked_read_equals_safetensors_and_refuses_corrupt_files(tmp_path, checkpoints):
    ours = read_checkpoint_chunked(checkpoints["llama"], torch.float32)
    theirs = list(read_checkpoint(checkpoints["llama"], torch.float32))
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(ours, theirs, strict=True))
    assert all(t.dtype == torch.bfloat16 for _, t in read_checkpoint_chunked(checkpoints["llama"], torch.bfloat16))

    mixed = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "flag": torch.tensor([True, False, True]),
        "f64": torch.randn(7).double(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "i8": torch.arange(3, dtype=torch.int8),
    }
    root = tmp_path / "mixed"
    root.mkdir()
    save_file(mixed, str(root / "model.safetensors"))
    got = dict(shard_io.tensors_from_buffer(shard_io.read_regular_file(root / "model.safetensors", None, 5), "m"))
    ref = load_file(str(root / "model.safetensors"))
    assert got.keys() == ref.keys()
    for key, tensor in ref.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape and torch.equal(got[key], tensor)

    # Offsets that are not a multiple of the dtype's size (the format allows it): copies, same values.
    header = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()  # fmt: skip
    b = torch.tensor([1.5, -2.0])
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(len(header).to_bytes(8, "little") + header + b"\x07" + b.numpy().tobytes())
    got = dict(shard_io.tensors_from_buffer(shard_io.read_regular_file(odd), "odd"))
    assert got["a"].tolist() == [7] and torch.equal(got["b"], b)

    data = (checkpoints["llama"] / "model.safetensors").read_bytes()
    for label, blob in {
        "truncated": data[: len(data) // 2],
        "garbage": b"\xff" * 64,
        "short": b"\x01\x02",
        "trailing bytes": data + b"\x00" * 4,
        "gap": len(header).to_bytes(8, "little") + header.replace(b"[1, 9]", b"[2, 10]") + b"\x00" * 10,
    }.items():
        bad = tmp_path / f"{label}.safetensors"
        bad.write_bytes(blob)
        with pytest.raises(WeightLoadError, match="cannot read"):
            shard_io.tensors_from_buffer(shard_io.read_regular_file(bad), bad.name)


def test_reader_stops_at_the_next_chunk_once_cancelled():
    class SlowFile:
        """Its second read blocks until released, as a read from a stalled mount does."""

        def __init__(self) -> None:
            self.calls = 0
            self.second_read_started = threading.Event()
            self.release = threading.Event()

        def readinto(self, view: memoryview) -> int:
            self.calls += 1
            if self.calls == 2:
                self.second_read_started.set()
                assert self.release.wait(10)
            view[:] = b"x" * len(view)
            return len(view)

    f, cancel = SlowFile(), threading.Event()
    outcome: dict[str, BaseException] = {}

    def read() -> None:
        try:
            shard_io.read_into(f, memoryview(bytearray(40)), "slow", cancel, chunk_bytes=4)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert f.second_read_started.wait(10)
    cancel.set()
    f.release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), shard_io.ReadCancelled)
    assert f.calls == 2  # no read after the one in progress when the caller gave up


# -- in-process: the daemon thread and the update's bound ------------------------------------------


def test_daemon_thread_answers_at_its_bound_and_is_abandoned():
    release, started = threading.Event(), threading.Event()
    seen_stop: list[threading.Event] = []

    def blocked(stop: threading.Event) -> str:
        seen_stop.append(stop)
        started.set()
        release.wait(10)
        return "too late"

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await run_on_daemon_thread(blocked, 0.2, name="test-blocked")
        assert await run_on_daemon_thread(lambda stop: 42, 10, name="test-quick") == 42
        with pytest.raises(KeyError):
            await run_on_daemon_thread(lambda stop: {}["missing"], 10, name="test-raises")
        # At shutdown every call still awaited is given up at once.
        waiting = asyncio.ensure_future(run_on_daemon_thread(blocked, 60, name="test-shutdown"))
        # Its thread runs once the call is registered as pending (both happen in the call's first step).
        await until(lambda: len(seen_stop) == 2, 10, "the second blocked call to start")
        assert abandon_pending("shutting down") == 1
        with pytest.raises(Abandoned, match="shutting down"):
            await asyncio.wait_for(waiting, 10)

    _bounded(lambda: asyncio.run(main()), 60)  # returns although a blocked thread is still running
    assert started.is_set() and all(stop.is_set() for stop in seen_stop) and len(seen_stop) == 2
    stuck = [t for t in threading.enumerate() if t.name in ("test-blocked", "test-shutdown")]
    assert len(stuck) == 2 and all(t.daemon for t in stuck)
    release.set()  # their results arrive after the loop closed and are dropped
    for thread in stuck:
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.process
def test_process_exits_while_a_read_is_stuck(tmp_path):
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    code = f"""
import asyncio, os
from worker.engine.daemon_thread import Abandoned, abandon_pending, run_on_daemon_thread

async def main():
    try:
        await run_on_daemon_thread(lambda stop: os.open({str(fifo)!r}, os.O_RDONLY), 0.5, name="stuck")
    except TimeoutError:
        print("timed out", flush=True)

asyncio.run(main())
print("exiting", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and proc.stdout.split() == ["timed", "out", "exiting"], proc.stderr


class StuckOpen:
    """Chunked reads block in the kernel while ``stuck`` (opening a FIFO nobody writes), else read normally."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo
        self.stuck = True
        self.blocked = threading.Event()
        self.real = shard_io.open_checked

    def __call__(self, path: Path) -> int:
        if not self.stuck:
            return self.real(path)
        self.blocked.set()
        os.close(os.open(self.fifo, os.O_RDONLY))
        raise WeightLoadError("released by the test")


@pytest.fixture
def stuck_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StuckOpen]:
    fifo = tmp_path / "hung-mount"
    os.mkfifo(fifo)
    stuck = StuckOpen(fifo)
    monkeypatch.setattr(shard_io, "open_checked", stuck)
    yield stuck

    def read_ended() -> bool:
        if not any(t.name == "checkpoint-read" and t.is_alive() for t in threading.enumerate()):
            return True
        _release_fifo_reader(fifo)
        return False

    wait_for(read_ended, 10, what="the abandoned read to end once released")


def _with_coordinator(model_dir: Path, body: Callable[[Coordinator], Coroutine[Any, Any, None]]) -> None:
    """Run ``body(coordinator)`` in a fresh event loop with a started in-process pipeline."""
    coord = Coordinator(Stage("llm", Scheduler(ModelWorker(str(model_dir)), rank=0, max_running_requests=4)))

    async def main() -> None:
        coord.stage.start()
        try:
            await body(coord)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, coord.stage.stop)

    _bounded(lambda: asyncio.run(main()), 120)


def test_stuck_read_is_abandoned_at_its_bound_and_changes_nothing(checkpoints, stuck_open):
    req = UpdateWeightsFromDiskRequest(model_path=str(checkpoints["llama_b"]))

    async def body(coord: Coordinator) -> None:
        before = coord.worker.run_checker("checksum").per_gpu_checksum
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(coord.one_step._read_checkpoint(req, 1.0), 30)
        assert stuck_open.blocked.is_set()
        # The whole update with a short bound ends too (504 is pinned by the next test), leaves the
        # weights alone and frees the worker for the next update.
        with pytest.raises((AdminTimeout, AdminBusy)):
            await asyncio.wait_for(coord.update_weights_from_disk(req, timeout_s=1.0), 30)
        assert coord.worker.run_checker("checksum").per_gpu_checksum == before
        stuck_open.stuck = False  # the mount answers again
        result = await asyncio.wait_for(coord.update_weights_from_disk(req, timeout_s=60.0), 90)
        assert result.success, result.message
        assert coord.worker.run_checker("checksum").per_gpu_checksum != before

    _with_coordinator(checkpoints["llama"], body)


def test_update_whose_read_is_stuck_answers_504_at_its_bound(checkpoints, stuck_open):
    req = UpdateWeightsFromDiskRequest(model_path=str(checkpoints["llama_b"]))

    async def body(coord: Coordinator) -> None:
        with pytest.raises(AdminTimeout):  # the route answers it with 504
            await asyncio.wait_for(coord.update_weights_from_disk(req, timeout_s=1.0), 30)

    _with_coordinator(checkpoints["llama"], body)


# -- real workers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bw(worker_factory, checkpoints):
    return worker_factory(checkpoints["llama"])


class HealthWatch:
    """Polls ``/health`` with a 1 s timeout on a thread; records every failure."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.failures: list[str] = []
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, _ = http_json("GET", self.url + "/health", timeout=1.0)
                if status != 200:
                    self.failures.append(f"status {status}")
                self.answers += 1
            except OSError as exc:
                self.failures.append(repr(exc))
            self._stop.wait(0.1)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_special_files_are_a_400_at_once_and_change_nothing(bw, special, checkpoints):
    before = bw.checksum()
    with HealthWatch(bw.url) as health:
        for label, (root, file, kind) in special.items():
            status, body = bw.post("/update_weights_from_disk", {"model_path": str(root)}, timeout=10)
            assert status == 400, (label, body)
            message = body["message"].lower()
            assert file in message and kind in message and body["weights"] == "intact", (label, message)
    assert not health.failures and health.answers > 0, health.failures
    assert bw.checksum() == before

    bw.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"])})
    assert bw.checksum() != before
    bw.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    assert bw.checksum() == before


#: How long a second update waits for the writer lock before its 503, in the stuck worker. Its
#: default (``router.contract.budget.HOP_MARGIN_S``, 30 s) has no flag; the 503 and the name of the
#: holder do not depend on its size, and the stuck read outlasts any bound (it never ends by itself).
WRITER_WAIT_S = 2.0

# A worker whose chunked reads block in the kernel after every check passed, as on a hung mount:
# opening a FIFO for reading waits for a writer, and none ever comes.
_STUCK_WORKER = f"""
import os, sys
from pathlib import Path
from worker import update_pipeline
from worker.model import shard_io

def open_stuck(path):
    Path(os.environ["STUCK_MARK"]).write_text(str(path))
    return os.open(os.environ["STUCK_FIFO"], os.O_RDONLY)

shard_io.open_checked = open_stuck
update_pipeline.WRITER_WAIT_S = {WRITER_WAIT_S!r}
from worker.cli import main
sys.exit(main())
"""


@pytest.mark.process
def test_stuck_read_keeps_worker_live_and_sigterm_still_exits(tmp_path, checkpoints):
    fifo, mark = tmp_path / "hung-mount", tmp_path / "read-started"
    os.mkfifo(fifo)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-c", _STUCK_WORKER, "--model-path", str(checkpoints["llama"])]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = ManagedProcess(f"stuck-worker-{port}", argv, env={"STUCK_FIFO": str(fifo), "STUCK_MARK": str(mark)})
    proc.start()
    try:
        proc.wait_http_ready(url + "/health", timeout=90)
        update = {"model_path": str(checkpoints["llama_b"])}
        first: dict[str, Any] = {}

        def post_update() -> None:
            try:
                first["answer"] = http_json("POST", url + "/update_weights_from_disk", update, timeout=60)
            except OSError as exc:  # the worker goes away under it
                first["answer"] = repr(exc)

        updater = threading.Thread(target=post_update, daemon=True)
        updater.start()
        wait_for(mark.exists, 30, proc, "the update's read to block")

        with HealthWatch(url) as health:
            status, out = http_json(
                "POST",
                url + "/generate",
                # Greedy and past EOS: the tiny random model may otherwise sample its stop token first.
                {
                    "text": "still serving",
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                },
                timeout=30,
            )
            assert status == 200 and len(out["output_ids"]) == 4, out
            status, info = http_json("GET", url + "/model_info", timeout=5)
            assert status == 200 and info["model_path"] == str(checkpoints["llama"])
            # A second update waits for the writer lock with a bound and says who holds it.
            status, body = http_json("POST", url + "/update_weights_from_disk", update, timeout=60)
            assert status == 503 and "update_weights_from_disk" in body["error"]["message"], body
            assert f"within {WRITER_WAIT_S:g}s" in body["error"]["message"], body
        assert not health.failures and health.answers > 0, health.failures
        assert updater.is_alive()  # the first update is still waiting for its read

        assert proc.proc is not None
        os.killpg(proc.proc.pid, signal.SIGTERM)
        try:
            proc.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within 10 s of SIGTERM:\n{proc.log_text()}")
        updater.join(10)
        # The stuck update was given up at shutdown and answered, weights untouched.
        status, body = first["answer"]
        assert status == 400 and "shutting down" in body["message"] and body["weights"] == "intact", body
    finally:
        proc.kill()
        _release_fifo_reader(fifo)
