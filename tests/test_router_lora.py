"""LoRA adapters across a fleet through the router: loaded everywhere or nowhere, routed to their holders,
unloaded once their requests end.

Two real omni-workers behind a router with two data-plane processes (the snapshot carries the adapter
table, the load reports carry the requests in flight per adapter). The workers differ in
``--max-lora-rank`` only, so a rank-8 adapter loads on one and is refused by the other: the all-or-nothing
path runs against real refusals. Tokens are checked against transformers + PEFT on the same adapter.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests._lora_helpers import hf_model, reference_greedy, write_adapter
from tests._polling import wait_for
from tests._router_fixtures import router_over, start_router
from tests._router_fixtures import workers as router_workers
from tests._tiers import process_fixture
from tests.procs import http_json, start_worker

PROMPT = [5, 17, 42, 9, 3]
STEPS = 6
LORA_ARGS = ["--enable-lora", "--max-loras", "4", "--step-delay-ms", "20"]


@pytest.fixture(scope="module")
def made(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """PEFT adapters on the llama checkpoint (``plain`` rank 8, ``rslora`` rank 4) and their greedy tokens."""
    root = tmp_path_factory.mktemp("router-lora")
    out: dict[str, Any] = {"base": reference_greedy(hf_model(checkpoints["llama"]), PROMPT, STEPS)}
    for label in ("plain", "rslora"):
        path, model = write_adapter(checkpoints["llama"], label, root / label)
        out[label] = (str(path), reference_greedy(model, PROMPT, STEPS))
    # The rank-4 adapter's shape with other tensors: the digest of an adapter a trainer meant, not the one on disk.
    other, _ = write_adapter(checkpoints["llama"], "rslora", root / "rslora-other", seed=99)
    out["other"] = (str(other), None)
    return out


@process_fixture(scope="module")
def fleet(checkpoints: dict[str, Path]) -> Iterator[tuple[str, list[str], list[Any]]]:
    """(router URL, [worker taking rank 8, worker taking rank 4 at most], their processes)."""
    wide = start_worker(checkpoints["llama"], extra_args=[*LORA_ARGS, "--max-lora-rank", "16"])
    narrow = start_worker(checkpoints["llama"], extra_args=[*LORA_ARGS, "--max-lora-rank", "4"])
    with router_over([wide, narrow], extra_args=["--data-plane-processes", "2"]) as fleet:
        yield fleet


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    return http_json("POST", url + path, body, timeout=timeout)


def _generate(url: str, lora_path: str | None = None, steps: int = STEPS) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True},
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    return _post(url, "/generate", body)


def _table(url: str) -> dict[str, Any]:
    status, body = http_json("GET", url + "/fleet/adapters", timeout=10)
    assert status == 200, body
    return {entry["name"]: entry for entry in body["adapters"]}


def _loaded_on(worker_url: str) -> set[str]:
    status, body = http_json("GET", worker_url + "/v1/models", timeout=10)
    assert status == 200, body
    return {card["id"] for card in body["data"] if card.get("parent")}


def _wait_routed(url: str, name: str, expected: list[int]) -> None:
    """The data planes apply the snapshot that carries a load within moments: poll until one serves it."""
    deadline = time.monotonic() + 10
    while True:
        status, answer = _generate(url, name)
        if status == 200:
            assert answer["output_ids"] == expected
            return
        assert status == 404 and time.monotonic() < deadline, (status, answer)
        time.sleep(0.1)


def test_a_load_that_every_worker_takes_is_routed_to_its_holders(fleet: Any, made: dict[str, Any]) -> None:
    url, workers, _ = fleet
    status, answer = _post(url, "/load_lora_adapter", {"lora_name": "small", "lora_path": made["rslora"][0]})
    assert status == 200 and answer["success"] and answer["worker_count"] == 2, answer
    entry = _table(url)["small"]
    assert (
        entry["version"] == 1
        and entry["serving"]
        and sorted(entry["holders"]) == sorted(r["worker"] for r in answer["results"])
    )
    _wait_routed(url, "small", made["rslora"][1])
    for _ in range(4):  # either worker serves it, with the adapter's tokens
        status, out = _generate(url, "small")
        assert status == 200 and out["output_ids"] == made["rslora"][1] and out["meta_info"]["lora_name"] == "small"
    status, out = _generate(url)
    assert status == 200 and out["output_ids"] == made["base"]
    # OpenAI routes choose it by model.
    body = {"model": "small", "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "return_token_ids": True}
    status, out = _post(url, "/v1/completions", {**body, "ignore_eos": True})
    assert status == 200 and out["choices"][0]["token_ids"] == made["rslora"][1], out
    for w in workers:
        assert "small" in _loaded_on(w)
    # Per adapter, from the control process (its gauges) and every data plane (the requests, summed).
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.read().decode())
            for s in family.samples
        }
    small = (("adapter", "small"),)
    assert samples[("omni_router_adapter_fleet_version", small)] == 1
    assert samples[("omni_router_adapter_holders", small)] == 2
    assert samples[("omni_router_adapter_serving", small)] == 1
    assert samples[("omni_router_adapter_requests_total", small)] >= 5  # the four above, the completion, the waits


def test_an_adapter_no_worker_holds_is_a_404_naming_the_loaded_ones(fleet: Any, made: dict[str, Any]) -> None:
    url, _, _ = fleet
    status, answer = _generate(url, "nowhere")
    assert status == 404 and "'nowhere'" in answer["error"]["message"] and "loaded:" in answer["error"]["message"]


def _adapter_digest(path: str) -> str:
    from safetensors.torch import load_file

    from router.trainer.digests import expected_adapter_checksum

    return expected_adapter_checksum(load_file(str(Path(path) / "adapter_model.safetensors")).items())


def test_a_load_is_published_only_when_every_worker_loaded_the_tensors_the_trainer_named(
    fleet: Any, made: dict[str, Any]
) -> None:
    from router.contract.weight_digest import EXPECTED_CHANGE_HEADER, EXPECTED_CHECKSUM_HEADER
    from router.trainer import RouterCallError, RouterClient

    url, workers, _ = fleet
    path, tokens = made["rslora"]
    digest = _adapter_digest(path)
    expect = {EXPECTED_CHECKSUM_HEADER: digest}
    body = {"lora_name": "proven", "lora_path": path}
    status, answer = http_json("POST", url + "/load_lora_adapter", body, headers=expect, timeout=120)
    assert status == 200 and {r["body"]["lora_checksum"] for r in answer["results"]} == {digest}, answer
    _wait_routed(url, "proven", tokens)
    # The trainer meant another adapter than the one the path holds: every worker loaded it, none is kept.
    meant = _adapter_digest(made["other"][0])
    wrong = {EXPECTED_CHECKSUM_HEADER: meant}
    status, answer = http_json("POST", url + "/load_lora_adapter", body, headers=wrong, timeout=120)
    message = answer["error"]["message"]
    assert status == 502 and not answer["success"] and "rolled back on 2 of 2" in message, answer
    assert f"it holds weights {digest}, not the expected {meant}" in message
    entry = _table(url)["proven"]
    assert entry["version"] == 1 and len(entry["holders"]) == 2 and entry["source"] == path, entry
    for _ in range(4):
        status, out = _generate(url, "proven")
        assert status == 200 and out["output_ids"] == tokens
    # Where no answer could show the adapter's digest, or on a change of base weights' header: 400, nothing sent.
    v1 = {"lora_name": "proven", "lora_path": path, "load_inplace": True}
    for route, refused_body, headers in (
        ("/v1/load_lora_adapter", v1, expect),
        ("/skyrl/v1/load_lora_adapter", {"lora_name": "proven", "lora_path": path}, expect),
        ("/load_lora_adapter", body, {EXPECTED_CHANGE_HEADER: "unchanged"}),
        ("/unload_lora_adapter", {"lora_name": "proven"}, expect),
    ):
        status, answer = http_json("POST", url + route, refused_body, headers=headers, timeout=60)
        assert status == 400 and answer["error"]["message"], (route, answer)
    assert _table(url)["proven"]["version"] == 1
    # RouterClient sends the digest: the right one updates the adapter, a wrong one raises and keeps it.
    client = RouterClient(url)
    assert client.load_lora_adapter("proven", path, expected_checksum=digest).success
    assert _table(url)["proven"]["version"] == 2
    with pytest.raises(RouterCallError) as failed:
        client.load_lora_adapter("proven", path, expected_checksum=meant)
    assert failed.value.status == 502 and len(failed.value.failed_workers()) == 2
    assert _table(url)["proven"]["version"] == 2
    assert all("proven" in _loaded_on(w) for w in workers)
    status, _ = _post(url, "/unload_lora_adapter", {"lora_name": "proven"})
    assert status == 200


def test_a_load_one_worker_refuses_is_rolled_back_everywhere(fleet: Any, made: dict[str, Any]) -> None:
    url, (wide, narrow), _ = fleet
    status, answer = _post(url, "/load_lora_adapter", {"lora_name": "big", "lora_path": made["plain"][0]})
    assert status in (400, 502) and not answer["success"], answer
    assert "rolled back on 1 of 1" in answer["message"], answer["message"]
    assert "big" not in _table(url)
    assert "big" not in _loaded_on(wide) and "big" not in _loaded_on(narrow)
    status, _ = _generate(url, "big")
    assert status == 404
    # An update that one worker refuses leaves every worker on the version the fleet had.
    _post(url, "/load_lora_adapter", {"lora_name": "kept", "lora_path": made["rslora"][0]})
    _wait_routed(url, "kept", made["rslora"][1])
    status, answer = _post(url, "/load_lora_adapter", {"lora_name": "kept", "lora_path": made["plain"][0]})
    assert not answer["success"] and "rolled back on 1 of 1" in answer["message"], answer
    entry = _table(url)["kept"]
    assert entry["version"] == 1 and len(entry["holders"]) == 2 and entry["source"] == made["rslora"][0]
    for _ in range(4):
        status, out = _generate(url, "kept")
        assert status == 200 and out["output_ids"] == made["rslora"][1]


def test_an_unload_waits_for_the_requests_naming_the_adapter(fleet: Any, made: dict[str, Any]) -> None:
    url, workers, _ = fleet
    _post(url, "/load_lora_adapter", {"lora_name": "going", "lora_path": made["rslora"][0]})
    _wait_routed(url, "going", made["rslora"][1])
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(_generate, url, "going", 40)  # 20 ms a step: about a second
        wait_for(lambda: sum(w["inflight"] for w in router_workers(url, None)) == 1, 10, what="the request running")
        status, answer = _post(url, "/unload_lora_adapter", {"lora_name": "going"})
        status_running, out = running.result(timeout=60)
    assert status == 200 and answer["success"], answer
    assert status_running == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"][:STEPS] == made["rslora"][1]
    assert "going" not in _table(url)
    for w in workers:
        assert "going" not in _loaded_on(w)
    status, refused = _generate(url, "going")
    assert status == 404 and "'going'" in refused["error"]["message"]
    status, _ = _post(url, "/unload_lora_adapter", {"lora_name": "going"})
    assert status == 404


def test_the_trainer_client_pushes_an_adapter_in_one_call(fleet: Any, made: dict[str, Any]) -> None:
    from router.trainer import RouterCallError, RouterClient

    url, _, _ = fleet
    client = RouterClient(url)
    answer = client.load_lora_adapter("policy-v1", made["rslora"][0])
    assert answer.success and answer.worker_count == 2
    assert {r.body.lora_version for r in answer.results if r.body is not None} == {1}
    assert "policy-v1" in {entry.name for entry in client.fleet_adapters().adapters}
    _wait_routed(url, "policy-v1", made["rslora"][1])
    with pytest.raises(RouterCallError) as refused:  # a worker's rank limit: nowhere, rolled back where taken
        client.load_lora_adapter("policy-v2", made["plain"][0])
    assert refused.value.failed_workers() and "policy-v2" not in _table(url)
    assert client.unload_lora_adapter("policy-v1").success
    assert "policy-v1" not in _table(url)


def test_a_restarted_worker_is_given_the_fleets_adapters_before_it_serves_them(
    fleet: Any, made: dict[str, Any]
) -> None:
    url, (wide, _), (wide_proc, _) = fleet
    _post(url, "/load_lora_adapter", {"lora_name": "back", "lora_path": made["rslora"][0]})
    _wait_routed(url, "back", made["rslora"][1])
    wide_proc.kill()
    wide_proc.start()
    wide_proc.wait_http_ready(wide + "/health", timeout=90)
    # A new process holds nothing; the router's catch-up may already be loading it, so that is not asserted
    # here: the new process can only hold the adapter below because the router gave it.
    wait_for(
        lambda: "back" in _loaded_on(wide) and len(_table(url)["back"]["holders"]) == 2,
        30,
        what="the restarted worker given the adapter",
    )
    holding = _table(url)["back"]["holders"]
    assert {h["version"] for h in holding.values()} == {1}
    for _ in range(4):  # both workers serve it again, with its tokens
        status, out = _generate(url, "back")
        assert status == 200 and out["output_ids"] == made["rslora"][1], out


def test_a_restarted_router_routes_the_adapters_it_had_loaded(fleet: Any, made: dict[str, Any], tmp_path: Path) -> None:
    _, workers, _ = fleet
    first, url = start_router(workers, state_dir=tmp_path, wait_healthy=2)
    try:
        # "small" is loaded on both workers already: through this router the load is an update of it.
        status, answer = _post(url, "/load_lora_adapter", {"lora_name": "small", "lora_path": made["rslora"][0]})
        assert status == 200 and answer["success"], answer
    finally:
        first.stop()
    second, url = start_router(workers, state_dir=tmp_path, wait_healthy=2)
    try:
        entry = _table(url)["small"]
        assert entry["version"] == 1 and len(entry["holders"]) == 2 and entry["source"] == made["rslora"][0]
        _wait_routed(url, "small", made["rslora"][1])  # once the workers are probed: the same processes hold it
        status, out = _generate(url, "small")
        assert status == 200 and out["output_ids"] == made["rslora"][1]
    finally:
        second.stop()


def test_skyrls_own_load_route_loads_fleet_wide_and_refuses_what_it_cannot(fleet: Any, made: dict[str, Any]) -> None:
    """SkyRL's client posts ``/skyrl/v1/load_lora_adapter`` (its vLLM server's route, vLLM's load in place) to
    every server: the router runs it as one fleet-wide load; an ``in_memory`` adapter, staged inside SkyRL's own
    workers, and a body naming no source or both are 400s that change nothing."""
    url, workers, _ = fleet
    before = _table(url)
    for bad in (
        {"lora_name": "sky", "in_memory": True},
        {"lora_name": "sky"},
        {"lora_name": "sky", "lora_path": str(made["rslora"][0]), "in_memory": True},
    ):
        status, answer = _post(url, "/skyrl/v1/load_lora_adapter", bad)
        assert status == 400 and answer["error"]["message"], (bad, answer)
    assert _table(url) == before and all("sky" not in _loaded_on(w) for w in workers)
    for version in (1, 2):  # the second load replaces the first in place, as SkyRL's route does
        status, answer = _post(
            url, "/skyrl/v1/load_lora_adapter", {"lora_name": "sky", "lora_path": str(made["rslora"][0])}
        )
        assert status == 200 and answer == {"status": "ok", "lora_name": "sky", "lora_int_id": version}, answer
        assert _table(url)["sky"]["version"] == version
    assert all("sky" in _loaded_on(w) for w in workers)
    _wait_routed(url, "sky", made["rslora"][1])
    status, _ = _post(url, "/v1/unload_lora_adapter", {"lora_name": "sky"})
    assert status == 200
