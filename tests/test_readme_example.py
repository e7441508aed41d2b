"""The README's trainer example, run as written against a real router and two real workers.

The ``python`` block under "## A trainer" is taken from README.md and executed with the names it
leaves to the reader (``KEY``, ``ADDR``, ``PORT``, ``model``) bound to a running fleet, and its
router address pointed at the router started here. The model is the served checkpoint, nudged so
the sync changes every weight; the example's own ``expected_checksum`` makes ``sync_weights`` check
that every rank of every worker holds exactly what was sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from router.trainer import SyncReport, sent_checksum
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, generate_via, start_router
from tests._tiers import process_fixture
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import free_port, http_json
from worker.model import read_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"
#: The address the example writes for its router.
EXAMPLE_ROUTER = "http://router:30000"


def trainer_example() -> str:
    """The first ``python`` block after the README's "## A trainer" heading."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## A trainer\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README.md's trainer section has no python block"
    return match.group(1)


class Policy:
    """What the example calls ``model``: checkpoint-named tensors in the served dtype."""

    def __init__(self, checkpoint: Path):
        self.tensors = {name: t + 0.01 for name, t in read_checkpoint(checkpoint, torch.float32)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


@process_fixture(scope="module")
def fleet_behind_router(
    worker_fleet: Callable[..., Fleet], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Fleet, str]]:
    fleet = worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS])
    router, url = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path_factory.mktemp("readme-state"))
    try:
        yield fleet, url
    finally:
        router.stop()


def test_example_block_names_its_settings_once() -> None:
    code = trainer_example()
    assert code.count(EXAMPLE_ROUTER) == 1
    assert code.count("client.sync_weights(") == 1
    # The sender's packing and the workers' reading are one setting: a second spelling could disagree.
    assert code.count('"flattened_bucket"') == 1


def test_readme_trainer_example_syncs_the_fleet(fleet_behind_router: tuple[Fleet, str]) -> None:
    fleet, router_url = fleet_behind_router
    policy = Policy(fleet.model)
    code = trainer_example().replace(EXAMPLE_ROUTER, router_url)
    namespace: dict[str, object] = {"KEY": ADMIN_KEY, "ADDR": "127.0.0.1", "PORT": free_port(), "model": policy}
    try:
        exec(compile(code, f"{README}:trainer example", "exec"), namespace)
    finally:
        sender = namespace.get("sender")
        if sender is not None:
            sender.close()  # type: ignore[attr-defined]

    report = namespace["report"]
    assert isinstance(report, SyncReport)
    assert report.weight_version == "step-7"
    assert report.matches_expected is True
    assert report.fleet_identical is True
    expected = sent_checksum(policy.tensors.items())
    ranks = [c for per_worker in report.rank_checksums.values() for c in per_worker]
    assert len(report.rank_checksums) == len(fleet.urls) and ranks and set(ranks) == {expected}
    for url in (*fleet.urls, router_url):
        status, info = http_json("GET", url + "/model_info", headers=auth())
        assert status == 200, info
        assert info["weight_version"] == "step-7"
    status, body, _ = generate_via(router_url)
    assert status == 200, body
    assert body["meta_info"]["weight_version"] == "step-7"
