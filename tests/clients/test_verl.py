"""verl 0.9.1's SGLang server adapter: one hybrid-replica weight sync through one omni-router URL.

verl's code runs in its own process (``_verl_driver``, whose docstring lists exactly what differs
from a GPU run: the CPU device mesh, torch's own tensor reducer instead of SGLang's CUDA-UUID
patch, and the two session methods SGLang 0.5.23 made abstract). It releases and resumes memory,
sends the new checkpoint as SGLang's ``LocalSerializedTensor`` pickles on
``/update_weights_from_tensor``, flushes, generates and aborts, all through the router to workers
started with ``--allow-pickled-tensors``. The effect is checked independently: every worker's greedy
tokens equal ``transformers``' on the checkpoint verl sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import http_json

pytest.importorskip("verl")
pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = Path(__file__).resolve().parent / "placeholders"


def test_verl_sglang_adapter_syncs_through_the_router(
    pickle_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], tmp_path: Path
) -> None:
    workers, router = pickle_fleet
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLACEHOLDERS), str(ROOT)])}
    out, err = tmp_path / "verl.out", tmp_path / "verl.err"
    # Files, not pipes: torch's shared-memory manager, started by the driver, outlives it and
    # would hold a pipe open.
    with out.open("w") as stdout, err.open("w") as stderr:
        run = subprocess.run(
            [sys.executable, "-m", "tests.clients._verl_driver", router, sync_ckpts["a"], sync_ckpts["b"]],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            timeout=180,
        )
    assert run.returncode == 0, err.read_text()[-4000:]
    answers = json.loads(out.read_text().strip().splitlines()[-1])
    assert len(answers["updates"]) > 1  # several buckets, each its own request
    assert all(update["success"] is True for update in answers["updates"]), answers["updates"]
    expected = hf_greedy(sync_ckpts["b"])
    assert answers["generate"]["output_ids"] == expected  # through verl's adapter and the router
    for url in workers:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 200 and answer["output_ids"] == expected, (url, answer)
