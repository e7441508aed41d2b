"""The main job, run as a user runs it: ``python -m demo``.

It starts a real router and two real workers and trains in its own process;
these tests read what it prints and check the processes it started are gone
afterwards (every URL it announced refuses connections).
"""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.process

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 180

STEP_ROW = re.compile(
    r"^\s+(\d+)\s+'.*'\s.*\s(\S+)\s+\d+/\d+\s+[\d.]+\s+(step-\d+)\s+[\d.]+s\*?\s+([0-9a-f= ]+?)\s+(ok|MISMATCH)$"
)
AFTER_ROW = re.compile(r"^after\s+'.*'\s.*\s(\S+)\s+\d+/\d+$")
URL_LINE = re.compile(r"^(router|worker\d+)\s+(http://\S+)")


def start_demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "demo", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = DEMO_TIMEOUT_S) -> str:
    """The demo's whole output; on a hang, stop it the way a user would (its clean-up runs) before failing."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        raise AssertionError(f"the demo did not finish within {timeout}s:\n{out}") from None


def announced_urls(out: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for line in out.splitlines() if (m := URL_LINE.match(line))}


def refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=5):
            return False
    except OSError:
        return True


def test_demo_trains_syncs_and_verifies_every_step():
    proc = start_demo("--steps", "2")
    out = finish(proc)
    assert proc.returncode == 0, out

    rows = [m for line in out.splitlines() if (m := STEP_ROW.match(line))]
    assert [int(m.group(1)) for m in rows] == [1, 2], out
    for m in rows:
        sums = m.group(4).split(" = ")
        # The trainer's checksum, then one per worker: all equal after every sync.
        assert len(sums) == 3 and len(set(sums)) == 1, m.group(0)
        assert m.group(5) == "ok", m.group(0)
    assert rows[0].group(4) != rows[1].group(4), "the second step did not change the weights"

    # Rollouts before step 1 come from the checkpoint's version; after the last sync from step-2.
    synced_as = [m.group(3) for m in rows]
    assert synced_as == ["step-1", "step-2"], out
    first_rollout_version = rows[0].group(2)
    assert first_rollout_version not in synced_as, out
    assert rows[1].group(2) == "step-1", out
    after = [m for line in out.splitlines() if (m := AFTER_ROW.match(line))]
    assert len(after) == 1 and after[0].group(1) == "step-2", out
    assert "fleet weight_version: step-2" in out, out

    urls = announced_urls(out)
    assert sorted(urls) == ["router", "worker0", "worker1"], out
    assert all(refuses_connections(u) for u in urls.values()), f"a process outlived the demo: {urls}"


def test_demo_interrupted_mid_training_stops_every_process():
    proc = start_demo("--steps", "500")
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        # Wait for the first table row: by then the router, workers and group are all up.
        while not any(STEP_ROW.match(line.rstrip("\n")) for line in seen[-1:]):
            line = lines.get(timeout=DEMO_TIMEOUT_S)
            assert line is not None, "the demo ended before its first step:\n" + "".join(seen)
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    out = "".join(seen)
    assert proc.returncode == 130, out
    assert "interrupted; stopping every process" in out, out
    urls = announced_urls(out)
    assert sorted(urls) == ["router", "worker0", "worker1"], out
    assert all(refuses_connections(u) for u in urls.values()), f"a process outlived the interrupted demo: {urls}"
