"""Stale requests dropped at a pause: real workers, a real router with two data-plane processes.

Requests are started on the fleet's version, with different ``X-Version-Policy`` values, and kept
in flight by slow decoding (``--step-delay-ms``, many tokens). A pause then drops, in every process,
the ones the next version makes stale under their policy: they are aborted on their workers by their
rid and their callers are answered 409 naming their start version, their policy and the version being
published (a stream already under way ends with that error as its last event). The others are held by
the pause and finish after the continue, as without this rule. Each request goes on its own
connection, so the kernel spreads them over both data planes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from router.contract.version_policy import parse_version_policy
from router.gateway.data_planes.hub import DataPlaneHub, _Plane
from router.gateway.data_planes.messages import TO_DATA_PLANE, DropStale, StaleDropped
from router.gateway.fleet.registry import WorkerRegistry, normalize_url, worker_id_for
from router.gateway.routing.stale import staleness_bound
from tests._router_fixtures import ADMIN_KEY, start_router, wait_for
from tests._stale_requests import (
    Sent,
    aborted_total,
    answered,
    continue_and_join,
    send_then_pause,
    stale_error,
)
from tests.procs import ManagedProcess, http_json

DATA_PLANES = ["--data-plane-processes", "2", "--data-plane-ack-timeout-s", "5"]
#: Slow enough that every request is still decoding when the pause comes, whatever the machine's load: the test
#: waits until each one is in flight before it pauses, and a request needs TOKENS * STEP_MS to finish.
STEP_MS = "40"


@dataclass
class Fleet:
    router: ManagedProcess
    url: str
    worker_ids: list[str]


@pytest.fixture(scope="module")
def fleet(worker_fleet: Any) -> Iterator[Fleet]:
    urls = worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY, "--step-delay-ms", STEP_MS]).urls
    router, url = start_router(urls, admin_key=ADMIN_KEY, extra_args=DATA_PLANES)
    try:
        yield Fleet(router, url, [worker_id_for(normalize_url(u)) for u in urls])
    finally:
        router.stop()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_drops_the_requests_the_next_version_makes_stale(fleet: Fleet, mode: str) -> None:
    before = aborted_total(fleet.url)
    stale = [
        Sent(f"stale-{mode}-ms1-a", "max-staleness:1"),
        Sent(f"stale-{mode}-ms1-b", "max-staleness:1"),
        Sent(f"stale-{mode}-ms1-stream", "max-staleness:1", stream=True),
        Sent(f"stale-{mode}-latest", "latest-only"),
    ]
    kept = [
        Sent(f"kept-{mode}-any-a", "any"),
        Sent(f"kept-{mode}-any-b", "any"),
        Sent(f"kept-{mode}-ms2", "max-staleness:2"),
        Sent(f"kept-{mode}-default", None),  # no header: the router's default latest-only keeps today's behaviour
    ]
    threads = send_then_pause(fleet.router, fleet.url, stale + kept, mode)
    try:
        # The dropped callers are answered while the fleet is still paused: nothing waits for the continue.
        for sent in stale:
            wait_for(partial(answered, sent), 60, fleet.router, f"{sent.rid} answered")
        for sent in kept:
            assert sent.status is None and sent.error is None, f"{sent.rid} is held by the pause, not dropped"
    finally:
        continue_and_join(fleet.url, threads)
    for sent in stale:
        assert sent.error is None, sent.error
        body = stale_error(sent)
        assert body["error"]["type"] == "stale_request_aborted", body
        assert body["version_policy"] == sent.policy
        assert body["start_sequence"] == 0 and body["next_sequence"] == 1, body
        message = body["error"]["message"]
        assert "fleet version 0" in message and "(1)" in message and repr(sent.policy) in message, message
    for sent in kept:
        assert sent.status == 200, (sent.rid, sent.status, sent.body[:300])
        answer = json.loads(sent.body)
        assert answer["meta_info"]["finish_reason"]["type"] == "length", answer["meta_info"]
    # Each dropped request was aborted on its worker by its own rid, from whichever process held it.
    log = fleet.router.log_text(400_000)
    for sent in stale:
        assert re.search(rf"aborted rid {sent.rid} on w-\w+ \(200\)", log), f"{sent.rid} aborted on its worker"
    assert aborted_total(fleet.url) == before + len(stale)


def test_an_abort_pause_answers_the_stale_callers_why_and_the_others_as_before(fleet: Fleet) -> None:
    before = aborted_total(fleet.url)
    stale = Sent("abort-mode-stale", "max-staleness:0")
    kept = Sent("abort-mode-any", "any")
    threads = send_then_pause(fleet.router, fleet.url, [stale, kept], "abort")
    continue_and_join(fleet.url, threads)
    assert stale_error(stale)["error"]["type"] == "stale_request_aborted"
    # The pause itself aborted the one its policy keeps: the engine's own abort answer, as before.
    assert kept.status == 200, kept.body[:300]
    assert json.loads(kept.body)["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted_total(fleet.url) == before + 1


def test_areal_pause_drops_a_vllm_token_request_by_its_request_id(fleet: Fleet) -> None:
    """AReaL's pause reaches omni-worker as vLLM's aborting ``/pause``; the stale token request is aborted first
    in vLLM's own form, ``/abort_requests`` with the id vLLM runs it as (``generate-tokens-<request_id>``)."""
    before = aborted_total(fleet.url)
    stale = Sent("areal-stale", "max-staleness:1", tokens_route=True)
    kept = Sent("areal-kept", "any", tokens_route=True)
    threads = send_then_pause(fleet.router, fleet.url, [stale, kept], None, pause="/areal_pause_generation")
    continue_and_join(fleet.url, threads, resume="/areal_continue_generation")
    assert stale_error(stale)["version_policy"] == "max-staleness:1"
    assert kept.status == 200, kept.body[:300]  # aborted by the pause itself, as before: vLLM's answer
    assert json.loads(kept.body)["choices"][0]["finish_reason"] == "abort"
    log = fleet.router.log_text(400_000)
    assert re.search(r"aborted request generate-tokens-areal-stale on w-\w+ \(200\)", log), "by vLLM's form"
    assert aborted_total(fleet.url) == before + 1


def test_a_bad_policy_is_refused_and_counts_nothing(fleet: Fleet) -> None:
    before = aborted_total(fleet.url)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    status, answer = http_json(
        "POST", fleet.url + "/generate", body, headers={"X-Version-Policy": "max-staleness:-1"}, timeout=30
    )
    assert status == 400 and "max-staleness" in answer["error"]["message"], answer
    assert aborted_total(fleet.url) == before


# -- the rule and the bounded wait, in-process


@pytest.mark.parametrize(
    ("policy", "explicit", "bound"),
    [
        ("max-staleness:1", True, 1),
        ("max-staleness:3", False, 3),  # --version-policy max-staleness:3 judges requests without the header
        ("latest-only", True, 0),
        ("latest-only", False, None),  # the router's default: today's behaviour
        ("min-version:step-2", True, None),
        ("any", True, None),
    ],
)
def test_which_policies_a_pause_judges(policy: str, explicit: bool, bound: int | None) -> None:
    assert staleness_bound(parse_version_policy(policy), explicit) == bound


class _Socket:
    """A data plane's end of the link: ``answer`` is what it answers a drop with (``None``: it never answers)."""

    def __init__(self, hub: DataPlaneHub, index: int, answer: int | None) -> None:
        self.hub, self.index, self.answer = hub, index, answer
        self.orders: list[DropStale] = []

    async def send_str(self, text: str) -> None:
        order = TO_DATA_PLANE.validate_json(text)
        assert isinstance(order, DropStale)
        self.orders.append(order)
        if self.answer is not None:
            reply = StaleDropped(id=order.id, dropped=self.answer).model_dump_json()
            plane = self.hub._planes[self.index]
            asyncio.get_running_loop().call_soon(self.hub._receive, plane, reply)


async def test_a_data_plane_that_does_not_answer_does_not_hold_the_pause() -> None:
    hub = DataPlaneHub(WorkerRegistry(), ack_timeout_s=1.0, restart=lambda index, why: None)
    answering, silent = _Socket(hub, 0, 2), _Socket(hub, 1, None)
    for index, socket in enumerate((answering, silent)):
        hub._planes[index] = _Plane(index, socket)  # type: ignore[arg-type]  # the link's one method used here
    dropped = await hub.drop_stale(4, ["w-a"], wait_s=0.2)
    assert dropped == 2, "what the answering plane dropped; the silent one is left out"
    for socket in (answering, silent):
        assert [(o.next_sequence, o.workers) for o in socket.orders] == [(4, ["w-a"])]
        assert socket.orders[0].wait_s < 0.2, "each plane's own aborts are bounded inside the hub's wait"
