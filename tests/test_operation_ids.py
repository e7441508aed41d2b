"""One id per admin operation in the router's log and in every worker's, so one ``grep`` follows it.

A real router in front of two real workers: the caller's ``X-Request-Id`` becomes the operation's id;
without one the router names the operation itself. An id that could break a log line is not taken.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from tests._router_fixtures import start_router
from tests._tiers import process_fixture
from tests.procs import http_json


@process_fixture(scope="module")
def routed(worker_fleet: Any) -> Iterator[tuple[str, Any, Any]]:
    fleet = worker_fleet(2)
    router, url = start_router(fleet.urls, wait_healthy=2)
    try:
        yield url, router, fleet
    finally:
        router.stop()


def _logged(proc: Any, text: str, timeout_s: float = 5.0) -> str:
    """The log of ``proc`` once it holds ``text`` (logs are written as the calls end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log: str = proc.log_text(200_000)
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.05)


def test_the_callers_request_id_names_the_operation_everywhere(routed: Any) -> None:
    url, router, fleet = routed
    status, answer = http_json("POST", url + "/flush_cache", {}, headers={"X-Request-Id": "step-42.flush"})
    assert status == 200, answer
    assert "admin step-42.flush flush_cache: to 2 worker(s)" in _logged(router, "admin step-42.flush")
    assert "admin step-42.flush flush_cache: success in" in _logged(router, "success in")
    for proc in fleet.procs:
        assert "admin 'step-42.flush' POST /flush_cache: 200 in" in _logged(proc, "step-42.flush")


def test_without_one_the_router_names_the_operation(routed: Any) -> None:
    url, router, fleet = routed
    status, _ = http_json("POST", url + "/pause_generation", {"mode": "retract"})
    assert status == 200
    http_json("POST", url + "/continue_generation", {})
    found = re.findall(r"admin ([0-9a-f]{12}) pause_generation: to 2 worker", _logged(router, "pause_generation: to"))
    assert found, router.log_text(5000)
    for proc in fleet.procs:
        assert f"admin '{found[-1]}' POST /pause_generation: 200" in _logged(proc, found[-1])


def test_an_id_that_could_break_a_log_line_is_not_taken(routed: Any) -> None:
    url, router, _ = routed
    status, _ = http_json("POST", url + "/flush_cache", {}, headers={"X-Request-Id": "bad id;DROP"})
    assert status == 200
    assert "bad id" not in _logged(router, "bad id", timeout_s=0.5)
