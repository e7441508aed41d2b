"""An elastic fleet with real workers: a worker that joins after the first sync
gets no generation traffic while it serves its boot checkpoint, an update sent
on the group built before it joined is refused with 409 and reaches nobody, and
the trainer's next ``sync_weights`` rebuilds the group with the new world size,
after which the newcomer holds the trainer's weights and takes traffic. A
worker removed from the fleet shrinks the group the same way.

Real parts: a router (round-robin, so traffic spreads), three omni-workers on one
tiny llama, and the trainer in this process (``RouterClient.sync_weights`` with
``TrainerWeightSender`` over gloo).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from router.contract.weight_sync import DEFAULT_GROUP_NAME as GROUP
from router.trainer import BucketPlan, RouterClient, SyncReport, TrainerWeightSender, sent_checksum
from tests._router_fixtures import ADMIN_KEY, auth, by_url, generate_via, start_router, start_workers, wait_for
from tests._tiers import process_fixture
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import free_port, http_json
from worker.model.checkpoint import read_checkpoint


class Trainer:
    """The trainer's side: perturbed weights, the sender, and one sync per call."""

    def __init__(self, router_url: str, model: Any):
        self.client = RouterClient(router_url, admin_key=ADMIN_KEY)
        self.tensors = {n: t.clone() for n, t in read_checkpoint(model, torch.float32)}
        self.plan = BucketPlan.from_named_tensors(self.tensors, budget_bytes=64 * 1024)
        port = free_port()
        self.sender = TrainerWeightSender(master_port=port, world_size=1, timeout_s=60)
        self.group = self.sender.group_spec()
        self.step = 0

    def sync(self) -> tuple[SyncReport, str]:
        self.step += 1
        with torch.no_grad():
            for t in self.tensors.values():
                t.add_(0.001 * self.step)
        expected = sent_checksum(self.tensors.items())

        def broadcast(i: int) -> None:
            self.sender.send(BucketPlan((self.plan.buckets[i],), self.plan.budget_bytes), self.tensors)

        report = self.client.sync_weights(
            buckets=self.plan.metadata(),
            broadcast=broadcast,
            group=self.group,
            weight_version=f"step-{self.step}",
            expected_checksum=expected,
            timeout_s=60,
        )
        return report, expected

    def close(self) -> None:
        self.sender.close()


@process_fixture()
def fleet(checkpoints, tmp_path) -> Iterator[tuple[str, list[str], Trainer]]:
    procs = start_workers(checkpoints["llama"], 3, extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS])
    urls = [url for _, url in procs]
    router, url = start_router(
        urls[:2],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path / "state",
        # The pending rule itself: no catch-up from a peer (tests/test_router_catch_up.py covers that).
        extra_args=["--policy", "round_robin", "--health-check-interval-s", "0.5", "--sync-joiners", "off"],
    )
    trainer = Trainer(url, checkpoints["llama"])
    try:
        yield url, urls, trainer
    finally:
        trainer.close()
        router.stop()
        for proc, _ in procs:
            proc.stop()


def served_by(router_url: str, n: int) -> set[str]:
    """The worker ids that answered ``n`` generations through the router."""
    ids = set()
    for _ in range(n):
        status, body, worker = generate_via(router_url)
        assert status == 200, body
        assert worker is not None
        ids.add(worker)
    return ids


def receive_states(urls: list[str]) -> list[Any]:
    return [http_json("GET", u + "/health", timeout=10)[1]["receive"] for u in urls]


def test_a_late_worker_is_pending_until_the_rebuilt_group_brings_it_the_fleets_weights(fleet) -> None:
    url, urls, trainer = fleet
    first, _ = trainer.sync()
    assert first.world_size == 3 and first.matches_expected, first
    versions = {u: http_json("GET", u + "/get_weight_version", headers=auth(), timeout=10)[1] for u in urls[:2]}

    # A third worker joins (scale-up): it holds the boot checkpoint, so no traffic for it.
    status, added = http_json("POST", url + "/workers", {"url": urls[2]}, headers=auth(), timeout=30)
    assert status == 201, added
    newcomer = added["id"]
    wait_for(lambda: by_url(url, ADMIN_KEY)[urls[2]]["health"] == "healthy", 30, what="the newcomer's first probe")
    record = by_url(url, ADMIN_KEY)[urls[2]]
    assert record["pending"] and "joined or restarted" in record["pending"], record
    assert newcomer not in served_by(url, 8)

    # The rank plan changed at once; the old group no longer matches.
    status, world = http_json("GET", url + "/get_world_size", headers=auth(), timeout=30)
    assert status == 200 and world["world_size"] == 3, world
    (group,) = world["groups"]
    assert group["world_size"] == 3 and not group["matches_fleet"], group
    assert any(newcomer in change and "joined" in change for change in group["changes"]), group

    # An update on the stale group is refused before anything is fenced or broadcast.
    buckets = [b.model_dump(exclude_none=True) for b in trainer.plan.metadata()]
    for path, body in (
        ("/prepare_weights_update", {"group_name": GROUP, "num_buckets": len(buckets), "buckets": buckets}),
        ("/update_weights_from_distributed", {"group_name": GROUP, **buckets[0]}),
    ):
        status, answer = http_json("POST", url + path, body, headers=auth(), timeout=30)
        assert status == 409, (path, answer)
        assert newcomer in answer["error"]["message"] and "Nothing was broadcast" in answer["error"]["message"]
    assert receive_states(urls) == [None, None, None]
    assert http_json("GET", url + "/weight_update_journal", headers=auth(), timeout=10)[1]["pending"] is None
    assert not any(w["disabled"] for w in by_url(url, ADMIN_KEY).values())
    for u, before in versions.items():
        assert http_json("GET", u + "/get_weight_version", headers=auth(), timeout=10)[1] == before

    # The trainer's next sync rebuilds the group (world size 4) and the newcomer catches up.
    second, _ = trainer.sync()
    assert second.group_rebuilt and newcomer in second.group_rebuilt, second
    assert second.world_size == 4 and second.fleet_identical and second.matches_expected, second
    assert set(second.checksums) == {w["id"] for w in by_url(url, ADMIN_KEY).values()}
    assert len(set(second.checksums.values())) == 1, second.checksums
    assert by_url(url, ADMIN_KEY)[urls[2]]["pending"] is None
    assert newcomer in served_by(url, 9)

    # A worker leaves: the group shrinks on the next sync, and the remaining two stay in step.
    gone = by_url(url, ADMIN_KEY)[urls[0]]["id"]
    status, _ = http_json("DELETE", url + f"/workers/{gone}", headers=auth(), timeout=30)
    assert status == 200
    third, _ = trainer.sync()
    assert third.group_rebuilt and gone in third.group_rebuilt and third.world_size == 3, third
    assert third.fleet_identical and third.matches_expected, third
    assert gone not in served_by(url, 6)
