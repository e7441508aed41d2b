"""vLLM's server surface that trainers read, on a worker and through a router.

``/server_info?config_format=json`` answers vLLM's ``vllm_config`` (TRL reads
``weight_transfer_config``, ``model_config.logprobs_mode``, ``lora_config`` and
``parallel_config.data_parallel_size``), SGLang's shape without it; ``/reset_prefix_cache``
answers vLLM's 200 ``{"success": bool}``, ``false`` while a request holds cache.
Real worker processes (one slowed down so that a request stays in flight) and a real router.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests._router_fixtures import ADMIN_KEY, auth, running_fleet
from tests._tiers import process_fixture
from tests.procs import http_json

SLOW = ["--step-delay-ms", "40", "--num-threads", "1"]


@process_fixture(scope="module")
def fleet(checkpoints: dict[str, Path]) -> Iterator[tuple[list[str], str]]:
    with running_fleet(checkpoints["llama"], 2, worker_args=SLOW, admin_key=ADMIN_KEY) as fleet:
        yield fleet


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return http_json("GET", url, None, headers=headers)


def test_worker_server_info_in_both_shapes(fleet: tuple[list[str], str]) -> None:
    (worker, _), _router = fleet
    status, sglang = _get(worker + "/server_info")
    assert status == 200 and "vllm_config" not in sglang
    assert sglang["tp_size"] == 1 and sglang["internal_states"] and sglang["model_path"]

    status, info = _get(worker + "/server_info?config_format=json")
    assert status == 200, info
    config = info["vllm_config"]
    model = config["model_config"]
    _, model_info = http_json("GET", worker + "/model_info", None)
    assert model["model"] == model_info["model_path"] and model["dtype"] == "torch.float32"
    assert model["max_model_len"] == model_info["context_length"]
    assert model["logprobs_mode"] == "processed_logprobs"
    assert config["parallel_config"] == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "world_size": 1,
    }
    assert config["weight_transfer_config"] == {"backend": "torch"} and config["lora_config"] is None
    assert info["tp_size"] == 1  # SGLang's fields stay beside vLLM's

    status, text = _get(worker + "/server_info?config_format=text")
    assert status == 200 and isinstance(text["vllm_config"], str) and "tensor_parallel_size=1" in text["vllm_config"]
    status, bad = _get(worker + "/server_info?config_format=yaml")
    assert status == 400 and "config_format" in bad["error"]["message"]


def test_router_server_info_is_the_fleet_as_one_vllm_server(fleet: tuple[list[str], str]) -> None:
    _, router = fleet
    status, info = _get(router + "/server_info?config_format=json", auth())
    assert status == 200, info
    config = info["vllm_config"]
    assert config["parallel_config"]["data_parallel_size"] == 2
    assert config["parallel_config"]["tensor_parallel_size"] == 1
    assert config["weight_transfer_config"] == {"backend": "torch"}
    assert config["model_config"]["dtype"] == "torch.float32" and len(info["results"]) == 2
    # The router's world size (what a vLLM trainer adds itself to) covers both workers.
    assert _get(router + "/get_world_size", auth())[1]["world_size"] == 2
    status, sglang = _get(router + "/server_info", auth())
    assert status == 200 and sglang["vllm_config"] is None and sglang["worker_count"] == 2


def test_reset_prefix_cache_says_no_while_a_request_holds_cache(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    status, idle_worker = http_json("POST", worker + "/reset_prefix_cache", None)
    assert status == 200 and idle_worker["success"] is True
    status, idle = http_json("POST", router + "/reset_prefix_cache?reset_running_requests=false", None, headers=auth())
    assert status == 200 and idle["success"] is True and idle["worker_count"] == 2

    done = threading.Event()
    answers: list[Any] = []

    def long_generation() -> None:
        body = {"text": "hold", "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}
        answers.append(http_json("POST", worker + "/generate", body, timeout=120))
        done.set()

    thread = threading.Thread(target=long_generation, daemon=True)
    thread.start()
    try:
        polls = 400  # bounded: 20 s at most
        while _get(worker + "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 0 and polls:
            polls -= 1
            done.wait(0.05)
        status, busy = http_json("POST", worker + "/reset_prefix_cache", None)
        assert status == 200 and busy["success"] is False and busy["message"], busy
        status, fleet_busy = http_json("POST", router + "/reset_prefix_cache", None, headers=auth())
        assert status == 200 and fleet_busy["success"] is False and "retry" in fleet_busy["message"]
    finally:
        assert done.wait(120)
    assert answers[0][0] == 200
    assert http_json("POST", worker + "/reset_prefix_cache", None)[1]["success"] is True
