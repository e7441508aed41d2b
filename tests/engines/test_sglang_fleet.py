"""SGLang servers behind a real omni-router: SGLang 0.5.23's own HTTP server, routes, auth and tokenizer manager
over a stand-in scheduler (:mod:`tests.engines.sglang_standin`; SGLang has no CPU build).

What the router must do with SGLang's answers, each effect read back from the servers: detect them, take an
empty ``/health`` as healthy, keep a paused server healthy although its ``/health`` parks and then answers 503,
relay its text, empty and ``null`` answers as typed successes, pass the worker key, read the version from
``/model_info`` after an update from disk, keep a server whose update failed fenced (SGLang's rollback reloads
from the path that failed), and load the fleet's checkpoint into a restarted server before it takes traffic.
Runs in the engine tier only (``make test-engines``).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from router.contract.weight_digest import EXPECTED_CHANGE_HEADER, EXPECTED_CHECKSUM_HEADER
from router.trainer.digests import expected_checksum
from tests._polling import wait_for
from tests.engines._sglang_standin import STOP_TIMEOUT_S, SglangStandin, ready_standins, start_standin
from tests.engines.conftest import AUTH, Router
from tests.procs import http_json
from worker.model.checkpoint import read_checkpoint

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here"),
    pytest.mark.timeout(600),
]

#: The servers' own admin key; the router presents it to them (``--worker-api-key``), never a caller's.
WORKER_KEY = "sglang-worker-key"
#: SGLang's health timeout (whole seconds): a /health sent while paused answers 503 after this long.
HEALTH_TIMEOUT_S = 2
SERVER_ARGS = ["--admin-api-key", WORKER_KEY]
SERVER_ENV = {"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S)}
GENERATE = {"input_ids": [256, 72, 101, 108, 108, 111], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def _real_sglang_here() -> bool:
    """A GPU and SGLang's GPU stack: the real server can run (the stand-in stands in for it everywhere else)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("sgl_kernel") is not None


@pytest.fixture(scope="module", params=["standin", pytest.param("real", marks=pytest.mark.gpu)])
def pair(request: pytest.FixtureRequest, ckpts: dict[str, Path]) -> Iterator[list[SglangStandin]]:
    """Two SGLang servers on checkpoint A: the stand-in, and where a GPU and SGLang's GPU stack are present,
    real ``sglang.launch_server`` processes (the same tests, against SGLang's scheduler and model)."""
    real = request.param == "real"
    if real and not _real_sglang_here():
        pytest.skip("a real SGLang server needs a CUDA device and SGLang's GPU stack (sgl_kernel)")
    module = "sglang.launch_server" if real else None
    servers = [start_standin(ckpts["a"], extra_args=SERVER_ARGS, env=SERVER_ENV, module=module) for _ in range(2)]
    with ready_standins(servers):
        yield servers


@pytest.fixture
def router(pair: list[SglangStandin], router_for: Any) -> Router:
    made: Router = router_for([s.url for s in pair], "--worker-api-key", WORKER_KEY, "--policy", "round_robin")
    return made


def model_info(server: SglangStandin) -> dict[str, Any]:
    status, info = http_json("GET", server.url + "/model_info")
    assert status == 200, info
    return dict(info)


def test_sglang_workers_are_detected_and_routed(router: Router) -> None:
    for w in router.workers():
        assert (w["engine"], w["tp_size"], w["health"]) == ("sglang", 1, "healthy"), w
        assert w["instance_id"].startswith("sglang-"), w
    status, answer = http_json("POST", router.url + "/generate", GENERATE)
    assert status == 200 and answer["meta_info"]["weight_version"] == "default", answer
    # vLLM's dialect is not SGLang's: refused before anything is sent.
    status, body = router.call("POST", "/pause?mode=keep")
    assert status == 400 and len(body["unserved"]) == 2, body


def test_answers_without_json_are_typed_successes(router: Router, pair: list[SglangStandin]) -> None:
    flushed = router.ok("POST", "/flush_cache")
    assert all(r["success"] and r["body"]["message"].startswith("Cache flushed.") for r in flushed["results"])
    aborted = router.ok("POST", "/abort_request", {"abort_all": True})
    assert all(r["success"] and r["status_code"] == 200 for r in aborted["results"]), aborted
    released = router.ok("POST", "/release_memory_occupation", {})
    assert released["success"] and all(w["asleep"] for w in router.workers())
    wait_for(lambda: all(w["pending"] for w in router.workers()), 30, router.proc, "both pending: weights released")
    router.ok("POST", "/resume_memory_occupation", {})
    wait_for(lambda: all(w["pending"] is None for w in router.workers()), 30, router.proc, "both serving again")
    assert http_json("POST", router.url + "/generate", GENERATE)[0] == 200


def test_a_paused_server_stays_healthy_although_its_health_route_parks(
    router: Router, pair: list[SglangStandin]
) -> None:
    """SGLang's ``/health`` parks while paused (then 503s and marks the server unhealthy when nothing else
    reaches its scheduler meanwhile: tests/engines/test_sglang_standin.py); the router probes a paused worker on
    ``/model_info`` instead."""
    router.ok("POST", "/pause_generation", {"mode": "in_place"})
    # A window of about 16 probe rounds (every 0.5 s) while paused: none counts against the workers (3 failed
    # probes would make them unhealthy). The sleep paces the observation; it synchronises nothing.
    deadline = time.monotonic() + 4 * HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        assert all(w["health"] == "healthy" for w in router.workers()), router.workers()
        time.sleep(0.25)
    router.ok("POST", "/continue_generation", {})
    assert http_json("POST", router.url + "/generate", GENERATE)[0] == 200


def test_an_update_from_disk_is_recorded_and_a_failed_one_fails_closed(
    router: Router, pair: list[SglangStandin], ckpts: dict[str, Path]
) -> None:
    router.ok("POST", "/update_weights_from_disk", {"model_path": str(ckpts["b"]), "weight_version": "b-1"})
    assert [model_info(s)["weight_version"] for s in pair] == ["b-1", "b-1"]
    assert router.ok("GET", "/model_info")["weight_version"] == "b-1"
    latest = router.ok("GET", "/fleet/versions")["history"][-1]
    assert (latest["weight_version"], latest["source_path"]) == ("b-1", str(ckpts["b"]))
    checked = router.ok("POST", "/weights_checker", {"action": "checksum"})
    assert checked["identical"] is True, checked
    status, answer = http_json("POST", router.url + "/generate", GENERATE)
    assert status == 200 and answer["meta_info"]["weight_version"] == "b-1"

    status, failed = router.call("POST", "/update_weights_from_disk", {"model_path": "/nowhere", "weight_version": "x"})
    assert status in (400, 502) and not failed["success"], failed
    assert all(w["disabled"] for w in router.workers())
    assert router.ok("GET", "/weight_update_journal")["pending"]["state"] == "failed"
    router.ok("POST", "/weight_update_journal/resolve", {"acknowledge": True})
    assert not any(w["disabled"] for w in router.workers())


def test_a_restarted_server_loads_the_fleets_checkpoint_before_it_takes_traffic(
    router: Router, pair: list[SglangStandin], ckpts: dict[str, Path]
) -> None:
    """Last in this file: it replaces the second server."""
    router.ok("POST", "/update_weights_from_disk", {"model_path": str(ckpts["b"]), "weight_version": "b-2"})
    port = int(pair[1].url.rsplit(":", 1)[1])
    before = router.workers()[1]["instance_id"]
    pair[1].proc.stop(timeout=STOP_TIMEOUT_S)
    pair[1] = start_standin(ckpts["a"], port=port, extra_args=SERVER_ARGS, env=SERVER_ENV, module=pair[0].module)
    pair[1].proc.wait_http_ready(pair[1].url + "/ready", timeout=180)
    wait_for(lambda: router.workers()[1]["instance_id"] not in (None, before), 60, router.proc, "the new process")
    wait_for(lambda: router.workers()[1]["fleet_sequence"] is not None, 120, router.proc, "the catch-up")
    assert model_info(pair[1])["weight_version"] == "b-2"
    assert model_info(pair[1])["model_path"] == str(ckpts["b"])
    assert router.ok("POST", "/weights_checker", {"action": "checksum"})["identical"] is True


def test_an_update_is_published_only_on_the_weights_the_trainer_named(
    pair: list[SglangStandin], router_for: Any, ckpts: dict[str, Path]
) -> None:
    """The trainer's digest in SGLang's scheme (:func:`router.trainer.digests.expected_checksum`) is what the
    servers report; an update that leaves other weights (or, with ``--verify-updates changed``, the same ones) is
    a 502, fenced, its version not published."""
    digest = {name: expected_checksum(read_checkpoint(path, torch.float32), "sglang") for name, path in ckpts.items()}
    router: Router = router_for([s.url for s in pair], "--worker-api-key", WORKER_KEY, "--verify-updates", "changed")

    def update(name: str, version: str, **headers: str) -> tuple[int, Any]:
        body = {"model_path": str(ckpts[name]), "weight_version": version}
        return http_json("POST", router.url + "/update_weights_from_disk", body, headers=AUTH | headers, timeout=120)

    def resolve() -> None:
        router.ok("POST", "/weight_update_journal/resolve", {"acknowledge": True})

    # Onto A, whatever the servers held: A's digest, and no change required.
    status, answer = update("a", "a-1", **{EXPECTED_CHECKSUM_HEADER: digest["a"], EXPECTED_CHANGE_HEADER: "unchanged"})
    assert status == 200, answer
    checked = router.ok("POST", "/weights_checker", {"action": "checksum"})
    assert [r["body"]["ranks"][0]["per_gpu_checksum"] for r in checked["results"]] == [digest["a"]] * 2
    # A again, while B's weights are expected: the servers answer 200, the router publishes nothing.
    status, answer = update("a", "b-wrong", **{EXPECTED_CHECKSUM_HEADER: digest["b"]})
    assert status == 502 and set(answer["digests"].values()) == {digest["a"]}, answer
    assert all(w["disabled"] for w in router.workers())
    assert router.ok("GET", "/fleet/versions")["weight_version"] == "a-1"
    resolve()
    # A again with nothing said: under --verify-updates changed, an update that changed nothing is a failure.
    status, answer = update("a", "a-again")
    assert status == 502 and all("did not change" in r["error"] for r in answer["results"]), answer
    resolve()
    status, answer = update("b", "b-1", **{EXPECTED_CHECKSUM_HEADER: digest["b"]})
    assert status == 200, answer
    assert router.ok("GET", "/fleet/versions")["weight_version"] == "b-1"
    assert [model_info(s)["weight_version"] for s in pair] == ["b-1", "b-1"]
