"""An update is published only on the weights it should leave: the caller's digest, and ``--verify-updates changed``.

Real omni-workers and a real router. One worker runs with ``--fault-noop-updates``: it answers an update
from disk with success while reloading the checkpoint it holds, the shape of a transfer that moves
nothing (every worker so broken agrees with the others, so agreement alone cannot catch it). The
trainer's digest of the checkpoint it means the fleet to load comes from its tensors
(:func:`router.trainer.digests.expected_checksum`). Real processes because both sides of the check are the
worker's own: its update path (and the fault in it) and the checker that hashes the weights it serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from router.contract.weight_digest import EXPECTED_CHANGE_HEADER, EXPECTED_CHECKSUM_HEADER
from router.trainer import RouterCallError, RouterClient
from router.trainer.digests import expected_checksum
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, by_url, generate, start_router
from tests.procs import ManagedProcess, http_json
from worker.model.checkpoint import read_checkpoint


def digest_of(checkpoint: Path) -> str:
    return expected_checksum(read_checkpoint(checkpoint, torch.float32))


@pytest.fixture(scope="module")
def fleets(worker_fleet) -> tuple[Fleet, Fleet]:
    """A sound worker and one whose updates move nothing, both on checkpoint 0 (checkpoint 1 made beside)."""
    sound = worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY], seeds=(0, 1))
    broken = worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY, "--fault-noop-updates"], seeds=(0, 1))
    return sound, broken


@pytest.fixture
def router_of(tmp_path: Path) -> Iterator[Any]:
    started: list[ManagedProcess] = []

    def start(fleet: Fleet, *args: str) -> str:
        proc, url = start_router(
            fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / f"s{len(started)}", extra_args=args
        )
        started.append(proc)
        return url

    yield start
    for proc in started:
        proc.stop()


def update(url: str, checkpoint: Path, version: str, **headers: str) -> tuple[int, Any]:
    body = {"model_path": str(checkpoint), "weight_version": version}
    return http_json("POST", url + "/update_weights_from_disk", body, headers=auth() | headers, timeout=120)


def fleet_version(url: str) -> str | None:
    status, body = http_json("GET", url + "/fleet/versions", headers=auth(), timeout=10)
    assert status == 200, body
    return body["weight_version"]


def test_an_update_that_moves_nothing_is_not_published_when_the_trainer_names_its_weights(fleets, router_of) -> None:
    _, broken = fleets
    url = router_of(broken)
    old, new = digest_of(broken.model), digest_of(broken.others[0])
    before = fleet_version(url)
    status, answer = update(url, broken.others[0], "step-1", **{EXPECTED_CHECKSUM_HEADER: new})
    assert status == 502, answer
    (result,) = answer["results"]
    assert result["status_code"] == 200 and not result["success"]  # the engine said yes; the router did not
    assert f"holds weights {old}, not the expected {new}" in result["error"]
    assert answer["digests"] == {result["worker"]: old}
    # Fenced and journaled like any failed update; the label is not published.
    (worker,) = by_url(url, ADMIN_KEY).values()
    assert worker["disabled"] and fleet_version(url) == before
    status, journal = http_json("GET", url + "/weight_update_journal", headers=auth(), timeout=10)
    assert status == 200 and journal["pending"]["state"] == "failed"
    assert generate(url)[0] == 503  # no worker holds the fleet's weights


def test_with_verify_updates_changed_an_update_that_moves_nothing_fails_without_a_digest(fleets, router_of) -> None:
    _, broken = fleets
    url = router_of(broken, "--verify-updates", "changed")
    status, answer = update(url, broken.others[0], "step-1")
    assert status == 502, answer
    (result,) = answer["results"]
    assert "its weights did not change" in result["error"] and "verification" in answer["timings"]
    (worker,) = by_url(url, ADMIN_KEY).values()
    assert worker["disabled"]
    # A caller that means to reload what it holds says so, and is served.
    url = router_of(broken, "--verify-updates", "changed")
    status, answer = update(url, broken.model, "reload", **{EXPECTED_CHANGE_HEADER: "unchanged"})
    assert status == 200, answer
    assert fleet_version(url) == "reload"


def test_a_sound_update_is_published_with_its_digest_and_a_wrong_digest_is_refused(fleets, router_of) -> None:
    sound, _ = fleets
    url = router_of(sound, "--verify-updates", "changed")
    client = RouterClient(url, admin_key=ADMIN_KEY)
    target = sound.others[0]
    answer = client.update_weights_from_disk(str(target), weight_version="proved", expected_checksum=digest_of(target))
    assert answer.success and fleet_version(url) == "proved"
    assert set((answer.model_extra or {})["digests"].values()) == {digest_of(target)}
    assert generate(url)[0] == 200
    # Back to checkpoint 0, naming a digest no checkpoint has: the update is not published.
    with pytest.raises(RouterCallError) as refused:
        client.update_weights_from_disk(str(sound.model), weight_version="mislabelled", expected_checksum="ab" * 32)
    assert refused.value.status == 502 and fleet_version(url) == "proved"
    (worker,) = by_url(url, ADMIN_KEY).values()
    assert worker["disabled"]


def test_the_expectation_headers_are_refused_where_nothing_changes_weights_or_malformed(fleets, router_of) -> None:
    sound, _ = fleets
    url = router_of(sound)
    for path, body, headers in (
        ("/flush_cache", {}, {EXPECTED_CHECKSUM_HEADER: "ab" * 32}),
        ("/update_weights_from_disk", {"model_path": str(sound.model)}, {EXPECTED_CHECKSUM_HEADER: "not-hex"}),
        ("/update_weights_from_disk", {"model_path": str(sound.model)}, {EXPECTED_CHANGE_HEADER: "maybe"}),
    ):
        status, answer = http_json("POST", url + path, body, headers=auth() | headers, timeout=30)
        assert status == 400 and answer["error"]["message"], (path, answer)
    (worker,) = by_url(url, ADMIN_KEY).values()
    assert not worker["disabled"]  # refused before anything was locked, fenced or sent
