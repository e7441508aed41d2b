"""vLLM's ``/sleep``, ``/wake_up`` and ``/is_sleeping``, on a worker and through a router (real processes).

Level 1 releases the weights with a host copy: after the wake the same greedy tokens come back.
Level 2 drops them: after the wake the weights are partial and nothing is served (503, and the router
keeps the workers pending) until an update rewrites them. ``mode=keep`` retracts a request in flight,
which finishes after the wake; the default ``abort`` ends it. A level-0 sleep only pauses. Through
the router sleep and wake are fenced broadcasts like the memory routes; ``?tags=`` repeated is a
list. Bad parameters are 400s that change nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._router_fixtures import ADMIN_KEY, auth, running_fleet, wait_for, workers
from tests._tiers import process_fixture
from tests.procs import http_json

SLOW = ["--step-delay-ms", "20", "--num-threads", "1"]
PROMPT = [1, 2, 3, 4, 5, 6]
GEN = "/inference/v1/generate"


@process_fixture(scope="module")
def fleet(checkpoints: dict[str, Path]) -> Iterator[tuple[list[str], str]]:
    with running_fleet(checkpoints["llama"], 2, worker_args=SLOW, admin_key=ADMIN_KEY) as fleet:
        yield fleet


def _generate(base: str, tokens: int = 8, timeout: float = 60) -> tuple[int, Any]:
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": tokens, "ignore_eos": True}}
    return http_json("POST", base + GEN, body, timeout=timeout)


def _greedy(base: str, tokens: int = 8) -> list[int]:
    status, out = _generate(base, tokens)
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def _post(base: str, path: str, body: Any = None) -> tuple[int, Any]:
    return http_json("POST", base + path, body, headers=auth())


def _get(base: str, path: str) -> Any:
    status, out = http_json("GET", base + path, headers=auth())
    assert status == 200, out
    return out


def _routable(router: str) -> bool:
    return all(
        not w["disabled"] and not w.get("pending") and w["health"] == "healthy" for w in workers(router, ADMIN_KEY)
    )


def _settled(router: str) -> None:
    wait_for(lambda: _routable(router), 20, what="every worker routable")
    assert http_json("GET", router + "/weight_update_journal", headers=auth())[1]["pending"] is None


def test_level_1_keeps_the_weights_and_wake_up_restores_them(fleet: tuple[list[str], str]) -> None:
    workers_, router = fleet
    worker = workers_[1]
    before = _greedy(worker)
    status, out = _post(worker, "/sleep?level=1")
    assert status == 200 and out["released"] == ["weights", "kv_cache"] and out["is_sleeping"] is True, out
    assert _get(worker, "/is_sleeping") == {"is_sleeping": True}
    assert _get(worker, "/health")["weight_state"] == "released"
    status, out = _generate(worker)
    assert status == 503 and "released" in out["error"]["message"]
    status, out = _post(worker, "/wake_up?tags=weights")
    assert status == 200 and out["resumed"] == ["weights"] and out["is_sleeping"] is True  # kv_cache still asleep
    assert _get(worker, "/is_paused")["is_paused"] is True
    status, out = _post(worker, "/wake_up", {"tags": ["kv_cache"]})
    assert status == 200 and out["is_sleeping"] is False, out
    assert _get(worker, "/is_sleeping") == {"is_sleeping": False} and _get(worker, "/is_paused")["is_paused"] is False
    assert _greedy(worker) == before  # restored from the host copy, bit for bit
    _settled(router)


def _in_flight(base: str, out: list[Any], tokens: int = 60) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(_generate(base, tokens, timeout=120)), daemon=True)
    thread.start()
    return thread


def _state(worker: str, counter: str) -> int:
    return int(http_json("GET", worker + "/server_info")[1]["internal_states"][0][counter])


def _wait_running(worker: str) -> None:
    wait_for(lambda: _state(worker, "num_running_reqs") > 0, 30, what="the request running")


def test_keep_mode_retracts_a_request_that_finishes_after_the_wake(fleet: tuple[list[str], str]) -> None:
    workers_, router = fleet
    worker = workers_[0]
    expected = _greedy(worker, 60)
    out: list[Any] = []
    thread = _in_flight(worker, out)
    _wait_running(worker)
    status, answer = _post(worker, "/sleep?level=1&mode=keep")
    assert status == 200 and answer["is_sleeping"] is True, answer
    state = http_json("GET", worker + "/server_info")[1]["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1 and not out  # retracted, not ended
    assert _post(worker, "/wake_up")[0] == 200
    thread.join(60)
    status, body = out[0]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["token_ids"] == expected  # recomputed after the wake, same greedy tokens

    # The default mode aborts what runs, as vLLM's sleep does.
    out.clear()
    thread = _in_flight(worker, out)
    _wait_running(worker)
    assert _post(worker, "/sleep")[0] == 200
    thread.join(60)
    assert out[0][0] == 200 and out[0][1]["choices"][0]["finish_reason"] == "abort"
    assert _post(worker, "/wake_up")[0] == 200 and _greedy(worker, 60) == expected
    _settled(router)


def test_router_sleep_and_wake_are_fenced_broadcasts(fleet: tuple[list[str], str]) -> None:
    workers_, router = fleet
    _settled(router)
    before = _greedy(router)
    status, out = _post(router, "/sleep?level=1&tags=weights&tags=kv_cache")
    assert status == 200 and out["worker_count"] == 2 and out["released"] == ["weights", "kv_cache"], out
    assert _get(router, "/is_sleeping")["is_sleeping"] is True
    assert all(_get(w, "/health")["weight_state"] == "released" for w in workers_)
    status, out = _generate(router)
    assert status == 503  # no worker holds servable weights
    status, out = _post(router, "/wake_up?tags=weights")
    assert status == 200 and out["is_sleeping"] is True and _get(router, "/is_sleeping")["is_sleeping"] is True
    status, out = _post(router, "/wake_up?tags=kv_cache")
    assert status == 200 and out["is_sleeping"] is False, out
    assert _get(router, "/is_sleeping")["is_sleeping"] is False
    _settled(router)
    assert _greedy(router) == before

    # Level 0 only pauses: a request waits, and a wake of ``scheduling`` lets it run.
    status, out = _post(router, "/sleep?level=0&mode=keep")
    assert status == 200 and _get(router, "/is_sleeping")["is_sleeping"] is True
    assert all(_get(w, "/health")["weight_state"] == "serving" for w in workers_)
    waiting: list[Any] = []
    thread = _in_flight(router, waiting, 8)
    wait_for(
        lambda: sum(_state(w, "num_waiting_reqs") for w in workers_) == 1,
        30,
        what="the request queued on a paused worker",
    )
    assert not waiting
    assert _post(router, "/wake_up?tags=scheduling")[0] == 200
    thread.join(60)
    assert waiting[0][0] == 200 and waiting[0][1]["choices"][0]["token_ids"] == before
    assert _get(router, "/is_sleeping")["is_sleeping"] is False


def test_level_2_serves_nothing_until_the_weights_are_rewritten(
    fleet: tuple[list[str], str], checkpoints: dict[str, Path]
) -> None:
    workers_, router = fleet
    _settled(router)
    before = _greedy(router)
    assert _post(router, "/sleep?level=2")[0] == 200
    status, out = _post(router, "/wake_up")
    assert status == 200 and out["is_sleeping"] is False and out["weights_partial"] is True, out
    for worker in workers_:
        assert _get(worker, "/health")["weight_state"] == "partial"
        status, answer = _generate(worker)
        assert status == 503 and "partial" in answer["error"]["message"]
    assert _generate(router)[0] == 503
    assert all(w.get("pending") for w in workers(router, ADMIN_KEY))  # never routed
    status, out = _post(router, "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    assert status == 200, out
    _settled(router)
    assert _greedy(router) == before


@pytest.mark.parametrize(
    ("path", "body", "word"),
    [
        ("/sleep?level=3", None, "level"),
        ("/sleep?level=one", None, "level"),
        ("/sleep?mode=sideways", None, "mode"),
        ("/sleep?tags=bogus", None, "tags"),
        ("/sleep?tags=weights&tags=bogus", None, "tags"),
        ("/sleep", {"level": [1]}, "level"),
        ("/sleep?timeout_s=-1", None, "timeout_s"),
        ("/wake_up?tags=bogus", None, "tags"),
        ("/wake_up", {"tags": "weights"}, "tags"),
    ],
)
def test_bad_sleep_and_wake_are_400s_that_change_nothing(
    fleet: tuple[list[str], str], path: str, body: Any, word: str
) -> None:
    workers_, router = fleet
    for base in (workers_[0], router):
        status, answer = _post(base, path, body)
        assert status == 400 and word in answer["error"]["message"], (base, path, answer)
    assert http_json("POST", router + path, body)[0] == 401  # the router's admin routes need its key
    for worker in workers_:
        assert _get(worker, "/is_sleeping")["is_sleeping"] is False
        assert _get(worker, "/health")["weight_state"] == "serving"
    assert not any(w["disabled"] for w in workers(router, ADMIN_KEY))
    assert http_json("GET", router + "/weight_update_journal", headers=auth())[1]["pending"] is None
