"""``python -m demo --lora``, run as a user runs it: a LoRA adapter trained with PEFT and pushed to the
fleet through the router every step, each step verified by the demo itself (the versions the workers
report, the tokens the fleet serves against the trainer's own). These tests read what it prints."""

from __future__ import annotations

import re

import pytest

from tests.test_demo import announced_urls, finish, refuses_connections, start_demo

pytestmark = pytest.mark.process

#: The whole run takes seconds on a laptop; the bound is for a loaded machine.
DEMO_TIMEOUT_S = 120

#: step, loss, sync, adapter bytes, each worker's lora_version, served by, rollout, target match,
#: rollouts equal to the trainer's generation, the verdict.
STEP_ROW = re.compile(
    r"^\s+(\d+)\s+[\d.]+\s+[\d.]+ ms\s+(\d+) B\s+(\d+) (\d+)\s+worker.*\s\d+/\d+\s+(\d+)/(\d+)\s+(ok|FAILED)$"
)


def test_demo_lora_pushes_and_verifies_the_adapter_every_step() -> None:
    proc = start_demo("--lora", "--steps", "2")
    out = finish(proc, DEMO_TIMEOUT_S)
    assert proc.returncode == 0, out

    rows = [m for line in out.splitlines() if (m := STEP_ROW.match(line))]
    assert [int(m.group(1)) for m in rows] == [1, 2], out
    for m in rows:
        step = int(m.group(1))
        assert int(m.group(2)) > 0, m.group(0)  # adapter bytes pushed
        # One push per step, an update after the first: both workers report the step's version.
        assert (int(m.group(3)), int(m.group(4))) == (step, step), m.group(0)
        equal, served = int(m.group(5)), int(m.group(6))
        assert served >= 2 and equal == served, m.group(0)  # every rollout equals the trainer's tokens
        assert m.group(7) == "ok", m.group(0)
    assert "start: every worker's base-model rollout equals the trainer's untrained PEFT model" in out, out
    assert "fleet adapter 'policy': version 2 (source __tensor__), held by worker0=v2 worker1=v2" in out, out
    assert "2 of 2 pushes verified" in out, out

    urls = announced_urls(out)
    assert sorted(urls) == ["router", "worker0", "worker1"], out
    assert all(refuses_connections(u) for u in urls.values()), f"a process outlived the demo: {urls}"
