"""A worker that says its generation is paused while the router did not pause it takes no traffic, and the router
continues it before it takes traffic again.

The defect this guards against: a worker stopped (SIGSTOP) while the router paused the fleet applies that pause
once it runs again, after the rest of the fleet was continued; catch-up made its weights agree and it became
routable, and every request sent to it waited (a paused engine parks requests) until its caller gave up. Pausing a
worker directly, behind the router's back, leaves it in exactly that state, without the minute-long broadcast a
stopped worker costs. Real processes: what is proven is the router reading a real worker's state and the
requests it routes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from router.gateway.fleet.registry import PAUSED_BEHIND_ROUTER
from tests._router_fixtures import ADMIN_KEY, auth, by_url, generate_via, start_router, wait_for
from tests._worker_helpers import Worker
from tests.procs import http_json

OTHER_KEY = "a-key-the-router-does-not-hold"


def _pause_directly(url: str, key: str) -> None:
    status, body = http_json("POST", url + "/pause_generation", {"mode": "in_place"}, headers=auth(key), timeout=30)
    assert status == 200, body


def _paused(url: str) -> bool:
    return bool(http_json("GET", url + "/health", timeout=10)[1]["is_paused"])


def test_a_worker_paused_behind_the_router_is_continued_by_it(
    worker_factory: Callable[..., Worker], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    a, b = (worker_factory(checkpoints["llama"], "--admin-api-key", ADMIN_KEY) for _ in range(2))
    proc, url = start_router([a.url, b.url], admin_key=ADMIN_KEY, extra_args=["--policy", "round_robin"])
    try:
        _pause_directly(b.url, ADMIN_KEY)
        assert _paused(b.url)
        # Nobody but the router continues it; it took no traffic meanwhile (the probe took it out at once).
        wait_for(lambda: not _paused(b.url), 30, proc, "the router to continue the worker it found paused")
        # The router logs "continued" once it has read the worker again after the continue: a moment later.
        wait_for(lambda: "continued" in proc.log_text(), 10, proc, "the router to log the continue")
        log = proc.log_text()
        assert "is paused although the router did not pause it" in log and "continued" in log, log[-3000:]
        row = by_url(url, ADMIN_KEY)[b.url]
        wait_for(lambda: by_url(url, ADMIN_KEY)[b.url]["reported_paused"] is False, 10, proc, "its state read again")
        assert row["paused"] is False
        served = {generate_via(url)[2] for _ in range(6)}
        assert len(served) == 2, served
    finally:
        proc.stop()


def test_a_paused_worker_the_router_cannot_continue_takes_no_traffic_and_says_why(
    worker_factory: Callable[..., Worker], checkpoints: dict[str, Path], pool: ThreadPoolExecutor
) -> None:
    """The router holds no key for ``b`` (its continue is refused), so ``b`` stays paused: every request goes to
    ``a`` and answers at once (none parked), and ``GET /workers`` says why ``b`` takes none."""
    a = worker_factory(checkpoints["llama"], "--admin-api-key", ADMIN_KEY)
    b = worker_factory(checkpoints["llama"], "--admin-api-key", OTHER_KEY)
    proc, url = start_router([a.url, b.url], admin_key=ADMIN_KEY, extra_args=["--policy", "round_robin"])
    try:
        ids = {u: w["id"] for u, w in by_url(url, ADMIN_KEY).items()}
        _pause_directly(b.url, OTHER_KEY)
        wait_for(lambda: by_url(url, ADMIN_KEY)[b.url]["pending"] == PAUSED_BEHIND_ROUTER, 10, proc, "b out")
        row: dict[str, Any] = by_url(url, ADMIN_KEY)[b.url]
        assert row["reported_paused"] is True and row["paused"] is False and not row["disabled"], row
        # A request parked on b would wait until someone continues it: each of these must answer, from a.
        answers = list(pool.map(lambda _: generate_via(url, timeout=20), range(12)))
        assert all(status == 200 for status, _, _ in answers), answers
        assert {served for _, _, served in answers} == {ids[a.url]}
        assert _paused(b.url)  # the router could not continue it, and did not pretend to
        status, body = http_json(
            "POST", b.url + "/continue_generation", {}, headers=auth(OTHER_KEY), timeout=30
        )  # its operator continues it
        assert status == 200, body
        wait_for(lambda: by_url(url, ADMIN_KEY)[b.url]["pending"] is None, 10, proc, "b back in rotation")
        assert {generate_via(url)[2] for _ in range(6)} == set(ids.values())
    finally:
        proc.stop()


def test_a_worker_whose_memory_was_released_behind_the_router_is_resumed_by_it(
    worker_factory: Callable[..., Worker], checkpoints: dict[str, Path]
) -> None:
    a, b = (worker_factory(checkpoints["llama"], "--admin-api-key", ADMIN_KEY) for _ in range(2))
    proc, url = start_router([a.url, b.url], admin_key=ADMIN_KEY, extra_args=["--policy", "round_robin"])
    try:
        before = _checksum(b.url)
        status, body = http_json("POST", b.url + "/release_memory_occupation", {}, headers=auth(), timeout=30)
        assert status == 200, body
        # Nobody but the router resumes it; its weights come back bit for bit (a host copy) and it serves again.
        wait_for(lambda: _weight_state(b.url) == "serving", 30, proc, "the router to resume the worker's memory")
        assert "had its memory released behind the router: resumed" in proc.log_text()
        assert _checksum(b.url) == before
        wait_for(lambda: by_url(url, ADMIN_KEY)[b.url]["pending"] is None, 10, proc, "its state read again")
        served = {generate_via(url)[2] for _ in range(6)}
        assert len(served) == 2, served
    finally:
        proc.stop()


def _checksum(url: str) -> str:
    return http_json("GET", url + "/weights_checker", headers=auth(), timeout=30)[1]["per_engine_checksum"]


def _weight_state(url: str) -> str:
    return http_json("GET", url + "/model_info", headers=auth(), timeout=10)[1]["weight_state"]
