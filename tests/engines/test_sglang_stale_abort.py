"""Stale requests dropped at a pause, on SGLang: SGLang 0.5.23's own server and routes over the stand-in scheduler.

A request the next version makes stale is aborted through SGLang's own ``POST /abort_request {"rid": ...}``
(the route's answer is SGLang's empty 200) and its caller answered 409; one its policy keeps is held by
SGLang's own ``in_place`` pause and finishes after the continue. Runs in the engine tier only
(``make test-engines``).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests._polling import wait_for
from tests._stale_requests import Sent, aborted_total, answered, continue_and_join, send_then_pause, stale_error
from tests.engines._sglang_standin import SglangStandin, ready_standins, start_standin
from tests.engines.conftest import Router

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here"),
    pytest.mark.timeout(600),
]

WORKER_KEY = "sglang-worker-key"
#: One decode step of the stand-in: every request is still decoding at the pause (the tokens take minutes).
STEP_ARGS = ["--standin-step-ms", "100"]
#: ``<s>`` then "Hello" in the checkpoints' byte tokenizer.
PROMPT = {"input_ids": [256, 72, 101, 108, 108, 111]}


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]) -> Iterator[SglangStandin]:
    servers = [start_standin(ckpts["a"], extra_args=["--admin-api-key", WORKER_KEY, *STEP_ARGS])]
    with ready_standins(servers):
        yield servers[0]


@pytest.fixture
def router(server: SglangStandin, router_for: Any) -> Router:
    made: Router = router_for([server.url], "--worker-api-key", WORKER_KEY, "--worker-engine", "sglang")
    return made


def test_sglang_aborts_the_stale_request_by_its_rid_and_keeps_the_other(router: Router) -> None:
    before = aborted_total(router.url)
    stale = Sent("sglang-stale", "max-staleness:1", prompt=PROMPT)
    kept = Sent("sglang-kept", "any", prompt=PROMPT)
    threads = send_then_pause(router.proc, router.url, [stale, kept], "in_place")
    try:
        wait_for(partial(answered, stale), 60, router.proc, "the stale caller answered during the pause")
        assert not answered(kept), "the kept request is held by SGLang's pause"
    finally:
        continue_and_join(router.url, threads)
    body = stale_error(stale)
    assert (body["error"]["type"], body["version_policy"], body["start_sequence"]) == (
        "stale_request_aborted",
        "max-staleness:1",
        0,
    ), body
    assert kept.status == 200, kept.body[:300]
    # SGLang's /abort_request took the router's form ({"rid": ...}) with its own empty 200.
    assert re.search(r"aborted rid sglang-stale on w-\w+ \(200\)", router.proc.log_text(400_000))
    assert aborted_total(router.url) == before + 1
