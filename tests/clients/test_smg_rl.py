"""The SGLang Model Gateway's own RL client (``smg.rl`` of smg 1.13.0, unchanged) driving omni-router.

``smg.rl.RL`` lists the workers, pauses by selector, refits a subset from disk and resumes, through
omni-router's ``/v1/rl/*`` with the router's admin key. The effect is checked independently of the
project: each worker's greedy tokens equal those ``transformers`` computes on the checkpoint it
should now serve. Where omni-router is stricter than smg (a worker whose state is uncertain after a
failed call stays fenced, and ``paused``'s unconditional resume does not bring it back) the test
shows it through smg's own errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._router_fixtures import auth, running_fleet
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import http_json

smg_rl = pytest.importorskip("smg.rl")

KEY = "smg-rl-admin-key"
#: Nothing listens on the discard port of this loopback address.
UNREACHABLE = "http://127.0.0.2:9"


@pytest.fixture(scope="module")
def router(sync_ckpts: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """Two workers on checkpoint ``a`` behind a router that probes once at start-up (the tests register
    a worker nothing answers for, and it must stay a broadcast target rather than be found dead)."""
    with running_fleet(
        Path(sync_ckpts["a"]),
        2,
        worker_args=WORKER_ARGS,
        admin_key=KEY,
        router_args=["--health-check-interval-s", "3600"],
    ) as fleet:
        yield fleet


def _greedy(worker_url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
    status, answer = http_json("POST", worker_url + "/generate", body, timeout=60)
    assert status == 200, answer
    return list(answer["output_ids"])


def _router_workers(url: str) -> dict[str, dict[str, Any]]:
    status, body = http_json("GET", url + "/workers", headers=auth(KEY), timeout=10)
    assert status == 200, body
    return {w["url"]: w for w in body["workers"]}


def test_list_pause_refit_a_subset_and_resume(router: tuple[list[str], str], sync_ckpts: dict[str, str]) -> None:
    (first, second), url = router
    rl = smg_rl.RL(url, api_key=KEY, timeout=120)
    rows = {w.url: w for w in rl.workers()}
    assert set(rows) == {first, second}
    for w in rows.values():
        assert (w.engine, w.health, w.tp_size, w.connection_mode) == ("sglang", "ready", 1, "http")
        assert w.weight_version == "default" and "retract" in w.capabilities["pause_modes"]
    assert rl.worker(rows[first].id).url == first

    with smg_rl.paused(rl, "engine=sglang", mode="retract") as pause:
        assert pause.total == 2 and pause.succeeded == 2 and not pause.failed
        paused = rl.fanout("is_paused", method="GET", selector="control=paused")
        assert paused.total == 2 and all(r.body["is_paused"] for r in paused.results.values())
        refit = rl.fanout(
            "update_weights_from_disk",
            {"model_path": sync_ckpts["b"], "weight_version": "b"},
            selector=f"engine=sglang, id={rows[first].id}",
        )
        assert list(refit.results) == [rows[first].id] and refit.results[rows[first].id].status == 200
    assert {w.url: w.weight_version for w in rl.workers()} == {first: "b", second: "default"}
    assert {w.url: w.labels["omni.disabled"] for w in rl.workers()} == {first: "false", second: "false"}
    assert _greedy(first) == hf_greedy(sync_ckpts["b"]) and _greedy(second) == hf_greedy(sync_ckpts["a"])

    # The worker left behind, by its version; then one engine call to one worker.
    catch_up = rl.fanout(
        "update_weights_from_disk", {"model_path": sync_ckpts["b"], "weight_version": "b"}, selector="weight_version!=b"
    )
    assert list(catch_up.results) == [rows[second].id]
    one = rl.call(rows[second].id, "get_weight_version", method="GET")
    assert one.status == 200 and one.body["weight_version"] == "b"
    assert _greedy(second) == hf_greedy(sync_ckpts["b"])


def test_a_refused_refit_is_207_and_changes_nothing(router: tuple[list[str], str]) -> None:
    _, url = router
    rl = smg_rl.RL(url, api_key=KEY, timeout=120)
    before = {w.url: w.weight_version for w in rl.workers()}
    with pytest.raises(smg_rl.FanoutError) as caught:
        rl.fanout("update_weights_from_disk", {"model_path": "/nonexistent/checkpoint"}, selector="engine=sglang")
    assert caught.value.status == 207
    assert {(f.error, f.status) for f in caught.value.result.failed} == {("upstream_error", 400)}
    # Every worker refused before touching its weights: none is fenced, none changed.
    assert {w.url: w.weight_version for w in rl.workers()} == before
    assert all(not w["disabled"] for w in _router_workers(url).values())
    with pytest.raises(smg_rl.RlError) as refused:
        rl.worker("w-nosuchworker")
    assert refused.value.status == 404 and refused.value.payload["code"] == "worker_not_found"
    with pytest.raises(smg_rl.RlError) as refused:
        rl.fanout("pause_generation", {}, selector="colour=red")
    assert refused.value.status == 400 and refused.value.payload["code"] == "invalid_selector"


def test_a_failed_pause_keeps_the_uncertain_worker_fenced_after_smgs_resume(router: tuple[list[str], str]) -> None:
    (first, second), url = router
    # An omni-worker that stopped answering (named: an unreachable worker's engine cannot be detected).
    body = {"url": UNREACHABLE, "engine": "omni"}
    status, added = http_json("POST", url + "/workers", body, headers=auth(KEY), timeout=10)
    assert status == 201, added
    rl = smg_rl.RL(url, api_key=KEY, timeout=120)
    try:
        with pytest.raises(smg_rl.FanoutError) as caught, smg_rl.paused(rl, "engine=sglang"):
            pytest.fail("smg's paused() runs its body only when every pause succeeded")
        failed = caught.value.result.failed
        assert [(f.url, f.error) for f in failed] == [(UNREACHABLE, "upstream_unreachable")]
        # paused() resumed every worker; the two real ones serve again, the uncertain one stays out.
        state = _router_workers(url)
        assert (state[first]["disabled"], state[second]["disabled"], state[UNREACHABLE]["disabled"]) == (
            False,
            False,
            True,
        )
        for worker_url in (first, second):
            assert http_json("GET", worker_url + "/is_paused", timeout=10)[1]["is_paused"] is False
        # Until an operator resolves it, the router refuses further fenced calls (smg would carry on).
        with pytest.raises(smg_rl.RlError) as refused:
            rl.fanout("pause_generation", {}, selector="engine=sglang")
        assert refused.value.status == 409
    finally:
        http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True}, headers=auth(KEY), timeout=10)
        http_json("DELETE", url + f"/workers/{added['id']}", headers=auth(KEY), timeout=10)
