"""verl 0.9.1's SGLang rollout syncing an unmerged LoRA adapter through one omni-router URL.

verl's code runs in its own process (``_verl_lora_driver``, whose docstring lists what differs from
a GPU run). Per training step verl's ``ServerAdapter.update_weights`` with ``peft_config`` and
``base_sync_done`` lists ``/v1/models``, unloads its one adapter name (``verl_actor_lora_name``)
when it is there, and sends the new adapter as SGLang's serializer writes it on
``/load_lora_adapter_from_tensors``; generation names it in ``lora_path``. The workers run with
``--enable-lora --allow-pickled-tensors``. Every worker's greedy tokens with the adapter equal
transformers + PEFT's on the same adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._router_fixtures import running_fleet
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.clients.conftest import PROMPT
from tests.clients.test_trl_lora import STEPS, _adapter
from tests.procs import http_json

pytest.importorskip("verl")
pytest.importorskip("sglang")

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDERS = Path(__file__).resolve().parent / "placeholders"
NAME = "verl_actor_lora_name"  # verl's SGLANG_LORA_NAME
#: How a worker refuses an adapter sent as SGLang sends it (a dict), until it reads that form.


@pytest.fixture(scope="module")
def lora_pickle_fleet(sync_ckpts: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """Two LoRA-serving workers on checkpoint ``a`` that admit SGLang's pickled tensors."""
    args = [*WORKER_ARGS, "--enable-lora", "--max-loras", "2", "--allow-pickled-tensors"]
    with running_fleet(Path(sync_ckpts["a"]), 2, worker_args=args) as fleet:
        yield fleet


def _run_driver(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLACEHOLDERS), str(ROOT)])}
    out, err = tmp_path / "verl.out", tmp_path / "verl.err"
    # Files, not pipes: torch's shared-memory manager, started by the driver, outlives it.
    with out.open("w") as stdout, err.open("w") as stderr:
        run = subprocess.run(
            [sys.executable, "-m", "tests.clients._verl_lora_driver", *args],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            timeout=180,
        )
    assert run.returncode == 0, err.read_text()[-4000:]
    answers: dict = json.loads(out.read_text().strip().splitlines()[-1])
    return answers


def test_verl_syncs_its_adapter_through_the_router(
    lora_pickle_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], tmp_path: Path
) -> None:
    workers, router = lora_pickle_fleet
    made = [_adapter(sync_ckpts["a"], tmp_path / f"step-{step}", seed=10 + step) for step in (1, 2)]
    assert made[0][1] != made[1][1]
    answers = _run_driver(tmp_path, router, sync_ckpts["a"], *(path for path, _ in made))
    assert answers["sleep_level"] == 1  # verl serves the adapter unmerged, keeping the base weights

    first, second = answers["steps"]
    assert [call for call, _ in first["calls"]] == ["load_lora_adapter_from_tensors"]  # nothing to unload yet
    assert [call for call, _ in second["calls"]] == ["unload_lora_adapter", "load_lora_adapter_from_tensors"]
    unload = second["calls"][0][1]
    assert unload["success"] is True and unload["loaded_adapters"] == {}, unload
    versions = []
    for step, (_, expected) in zip((first, second), made, strict=True):
        load = step["calls"][-1][1]  # the router's answer, as verl's adapter got it
        assert load["success"] is True and load["loaded_adapters"] == {NAME: "__tensor__"}, load
        version = load["lora_version"]
        assert [(r["success"], r["body"]["lora_version"]) for r in load["results"]] == [(True, version)] * len(workers)
        versions.append(version)
        assert NAME in {card["id"] for card in step["models"]["data"]}  # what verl lists before its next sync
        assert step["generate"]["output_ids"] == expected  # through verl's adapter and the router
        assert (step["generate"]["meta_info"]["lora_name"], step["generate"]["meta_info"]["lora_version"]) == (
            NAME,
            version,
        )
    assert versions[1] == versions[0] + 1  # each load of the name is counted, across verl's unload

    for url in workers:  # the router loaded each step's adapter on both workers
        body = {
            "input_ids": PROMPT,
            "lora_path": NAME,
            "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True},
        }
        status, answer = http_json("POST", url + "/generate", body, timeout=60)
        assert status == 200 and answer["output_ids"] == made[1][1], (url, answer)
    status, table = http_json("GET", router + "/fleet/adapters", timeout=10)
    assert status == 200, table
    (adapter,) = table["adapters"]
    assert (adapter["name"], adapter["source"], adapter["serving"]) == (NAME, "__tensor__", True), adapter
    holders = adapter["holders"].values()
    assert len(holders) == len(workers) and all(h["version"] == adapter["version"] for h in holders), adapter
