"""Versioned LoRA adapters through the router: published beside the old ones without pausing, switched to in one
step, old ones dropped once unused, never more than ``--lora-keep-versions`` + 1 resident.

Two real omni-workers behind a router with two data-plane processes (the snapshot carries the table, the load
reports carry the requests in flight per version). The workers take at most 3 adapters (``--max-loras 3``):
with ``--lora-keep-versions 2`` a fourth resident version would make a worker refuse the next load, so the bound
is held by the workers themselves as well as read from their ``/v1/models``. Tokens are checked against
transformers + PEFT with each version's weights.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests._lora_helpers import peft_model, reference_greedy
from tests._polling import wait_for
from tests._router_fixtures import router_over
from tests._tiers import process_fixture
from tests.procs import http_json, start_worker

PROMPT = [5, 17, 42, 9, 3]
STEPS = 4
KEEP = 2
FLIPS = 20
FAMILY = "policy"
#: Bounds of the background load: it stops at whichever comes first (or when the flips are done).
LOAD_MAX_REQUESTS = 5000
LOAD_MAX_S = 120.0


@pytest.fixture(scope="module")
def versions(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, list[int]]]:
    """``FLIPS + 1`` PEFT adapters of one shape with different weights: (directory, greedy tokens) each."""
    import torch

    root = tmp_path_factory.mktemp("lora-versions")
    model = peft_model(checkpoints["llama"], "rslora")
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    made = []
    for k in range(FLIPS + 1):
        seeded = torch.Generator().manual_seed(1000 + k)
        with torch.no_grad():
            for p in lora:
                p.copy_(torch.randn(p.shape, generator=seeded) * 0.3)
        model.save_pretrained(str(root / f"v{k}"))
        made.append((str(root / f"v{k}"), reference_greedy(model, PROMPT, STEPS)))
    assert len({tuple(tokens) for _, tokens in made}) > FLIPS // 2  # the versions are told apart by their tokens
    return made


@process_fixture(scope="module")
def fleet(checkpoints: dict[str, Path]) -> Iterator[tuple[str, list[str], list[Any]]]:
    args = ["--enable-lora", "--max-loras", str(KEEP + 1), "--max-lora-rank", "8"]
    procs = [start_worker(checkpoints["llama"], extra_args=args) for _ in range(2)]
    with router_over(procs, extra_args=["--data-plane-processes", "2", "--lora-keep-versions", str(KEEP)]) as fleet:
        yield fleet


def _publish(url: str, name: str, versions: list[tuple[str, list[int]]], ks: tuple[int, ...]) -> None:
    """Load versions ``ks`` of adapter ``name`` (``name@v<k>``) from the made adapters, through the router."""
    for k in ks:
        body = {"lora_name": f"{name}@v{k}", "lora_path": versions[k][0]}
        status, answer = http_json("POST", url + "/load_lora_adapter", body)
        assert status == 200, answer


def _name(k: int) -> str:
    return f"{FAMILY}@v{k}"


def _load(url: str, k: int, path: str) -> tuple[int, Any]:
    return http_json("POST", url + "/load_lora_adapter", {"lora_name": _name(k), "lora_path": path}, timeout=120)


def _generate(url: str, lora_path: str) -> tuple[int, Any]:
    body = {
        "input_ids": PROMPT,
        "lora_path": lora_path,
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
    }
    return http_json("POST", url + "/generate", body, timeout=60)


def _resident(worker_url: str, family: str = FAMILY) -> set[str]:
    """The versions of ``family`` the worker itself lists as models."""
    status, body = http_json("GET", worker_url + "/v1/models", timeout=10)
    assert status == 200, body
    return {card["id"] for card in body["data"] if card.get("parent") and card["id"].startswith(family + "@")}


def _table(url: str) -> dict[str, Any]:
    status, body = http_json("GET", url + "/fleet/adapters", timeout=10)
    assert status == 200, body
    return {entry["name"]: entry for entry in body["adapters"]}


def _served_by(url: str, k: int) -> None:
    """The flip: requests naming the family are served by version ``k`` once the data planes applied it."""
    deadline = time.monotonic() + 10
    while True:
        status, answer = _generate(url, FAMILY)
        assert status == 200, answer
        if answer["meta_info"]["lora_name"] == _name(k):
            return
        assert time.monotonic() < deadline, answer["meta_info"]
        time.sleep(0.05)


class _Load:
    """Greedy requests naming the family without a version, from a thread, until stopped (bounded): every
    answer's status, the version that served it and its tokens."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str | None, list[int] | None]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + LOAD_MAX_S
        while not self.stop.is_set() and len(self.answers) < LOAD_MAX_REQUESTS and time.monotonic() < deadline:
            status, answer = _generate(self.url, FAMILY)
            ok = status == 200
            self.answers.append(
                (status, answer["meta_info"]["lora_name"] if ok else None, answer["output_ids"] if ok else None)
            )


class _Resident:
    """The most versions of the family any worker held, read from the workers' ``/v1/models`` until stopped."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        self.most = 0
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + LOAD_MAX_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            for w in self.workers:
                self.most = max(self.most, len(_resident(w)))
            time.sleep(0.02)


def test_twenty_flips_under_load_fail_no_request_and_keep_residents_bounded(
    fleet: tuple[str, list[str], list[Any]], versions: list[tuple[str, list[int]]]
) -> None:
    url, workers, _ = fleet
    status, answer = _load(url, 0, versions[0][0])
    assert status == 200 and answer["success"], answer
    _served_by(url, 0)
    load, resident = _Load(url), _Resident(workers)
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = [pool.submit(load.run), pool.submit(resident.run)]
        try:
            for k in range(1, FLIPS + 1):
                status, answer = _load(url, k, versions[k][0])
                assert status == 200 and answer["success"], (k, answer)
                _served_by(url, k)
                for w in workers:
                    held = _resident(w)
                    assert _name(k) in held and len(held) <= KEEP + 1, (k, w, held)
        finally:
            load.stop.set()
            resident.stop.set()
            for future in running:
                future.result(timeout=90)
    failed = [a for a in load.answers if a[0] != 200]
    assert not failed, failed[:5]
    assert resident.most <= KEEP + 1, resident.most
    served = {name for _, name, _ in load.answers}
    assert len(served) > FLIPS // 2, served  # the load ran across the flips
    for _, name, tokens in load.answers:
        assert name is not None and name.startswith(FAMILY + "@v"), name
        assert tokens == versions[int(name.rpartition("@v")[2])][1], (name, tokens)
    # Once the last drop is done: the newest KEEP versions, on every worker, and nothing else.
    newest = {_name(k) for k in range(FLIPS + 1 - KEEP, FLIPS + 1)}
    wait_for(lambda: {n for n in _table(url) if n.startswith(FAMILY + "@")} == newest, 30, what=f"only {newest} held")
    for w in workers:
        assert _resident(w) == newest, w
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        gauge = {
            s.labels["worker"]: s.value
            for family in text_string_to_metric_families(resp.read().decode())
            for s in family.samples
            if s.name == "omni_router_lora_resident_versions" and s.labels["adapter"] == FAMILY
        }
    assert len(gauge) == 2 and set(gauge.values()) == {KEEP}, gauge
    for version in sorted(newest):  # the other test's versions need the room
        status, _ = http_json("POST", url + "/unload_lora_adapter", {"lora_name": version})
        assert status == 200


def test_versions_are_immutable_and_a_version_not_held_is_a_404(
    fleet: tuple[str, list[str], list[Any]], versions: list[tuple[str, list[int]]]
) -> None:
    url, workers, _ = fleet
    name = "pin"
    _publish(url, name, versions, (1, 2))
    before = _table(url)
    # Loading a held version again, through either engine's route, or the name without a version: 409, nothing sent.
    for route, body in (
        ("/load_lora_adapter", {"lora_name": f"{name}@v1", "lora_path": versions[3][0]}),
        ("/v1/load_lora_adapter", {"lora_name": f"{name}@v2", "lora_path": versions[3][0], "load_inplace": True}),
        ("/load_lora_adapter", {"lora_name": name, "lora_path": versions[3][0]}),
    ):
        status, answer = http_json("POST", url + route, body, timeout=60)
        assert status == 409 and answer["error"]["message"], (route, answer)
    assert _table(url) == before
    # A pinned version serves itself; the name alone the latest; a version not held is a 404 naming the held ones.
    deadline = time.monotonic() + 10
    while (status := _generate(url, name)[0]) != 200:
        assert status == 404 and time.monotonic() < deadline
        time.sleep(0.05)
    for asked, k in ((f"{name}@v1", 1), (f"{name}@v2", 2), (name, 2)):
        status, answer = _generate(url, asked)
        assert status == 200 and answer["meta_info"]["lora_name"] == f"{name}@v{k}", answer
        assert answer["output_ids"] == versions[k][1]
    completion = {"model": name, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "return_token_ids": True}
    status, answer = http_json("POST", url + "/v1/completions", {**completion, "ignore_eos": True})
    assert status == 200 and answer["choices"][0]["token_ids"] == versions[2][1], answer
    for asked in (f"{name}@v9", f"{name}@v0"):
        status, answer = _generate(url, asked)
        message = answer["error"]["message"]
        assert status == 404 and "'v" in message and f"{name}@v1, {name}@v2" in message, answer
    status, answer = http_json("POST", url + "/v1/completions", {**completion, "model": f"{name}@v9"})
    assert status == 404 and f"{name}@v1, {name}@v2" in answer["error"]["message"], answer
    for k in (1, 2):
        status, _ = http_json("POST", url + "/unload_lora_adapter", {"lora_name": f"{name}@v{k}"})
        assert status == 200
    assert all(not _resident(w, name) for w in workers)


def test_a_restarted_worker_is_given_every_version_the_fleet_holds(
    fleet: tuple[str, list[str], list[Any]], versions: list[tuple[str, list[int]]]
) -> None:
    url, workers, procs = fleet
    name = "back"
    _publish(url, name, versions, (1, 2))
    procs[0].kill()
    procs[0].start()
    procs[0].wait_http_ready(workers[0] + "/health", timeout=90)
    # A new process holds nothing: it can only list both versions below because the router's catch-up gave them.
    wait_for(
        lambda: (
            _resident(workers[0], name) == {f"{name}@v1", f"{name}@v2"}
            and all(len(_table(url)[f"{name}@v{k}"]["holders"]) == 2 for k in (1, 2))
        ),
        30,
        what="the restarted worker given both versions",
    )
    for asked, k in ((name, 2), (f"{name}@v1", 1), (name, 2), (f"{name}@v1", 1)):  # either worker serves each
        status, answer = _generate(url, asked)
        assert status == 200 and answer["meta_info"]["lora_name"] == f"{name}@v{k}", answer
        assert answer["output_ids"] == versions[k][1]
    for k in (1, 2):
        status, _ = http_json("POST", url + "/unload_lora_adapter", {"lora_name": f"{name}@v{k}"})
        assert status == 200
