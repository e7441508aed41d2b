"""The demo's trainer: rollouts through the router, an optimizer step, a weight sync.

It is rank 0 of the weight-update group and talks to the fleet only through
the router URL: ``/generate`` for rollouts and the trainer client's
``sync_weights`` for the update cycle (group init on the first sync, pause,
prepare, broadcast, complete, verify against the trainer's own checksum,
continue).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from demo.policy import TrainablePolicy
from router.trainer import BucketPlan, GroupSpec, RouterCallError, RouterClient, SyncReport, TrainerWeightSender

LOAD_FORMAT = "flattened_bucket"
WORKER_HEADER = "X-Omni-Worker"


class DemoError(RuntimeError):
    """The system did something the demo must not accept (a failed rollout, a checksum mismatch)."""


@dataclass(frozen=True)
class Rollout:
    """One greedy completion, the weight_version that produced it and the worker that served it."""

    text: str
    output_ids: list[int]
    weight_version: str
    worker: str


@dataclass(frozen=True)
class StepResult:
    """What one training step produced: its rollouts, loss, the trainer's checksum and the sync report."""

    step: int
    rollouts: list[Rollout]
    loss: float
    trainer_checksum: str
    sync: SyncReport


def post_generate(
    router_url: str, body: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any], str] | urllib.error.HTTPError:
    """POST ``body`` to the router's ``/generate``: the answer and the id of the worker that served it.

    A refusal comes back as the router's ``HTTPError`` (body unread) instead of being raised, because what
    it means is the caller's to say: the LoRA demo waits out a 404 while a new adapter reaches the router's
    data planes, a full-weight rollout fails on any. No answer at all raises :class:`DemoError`.
    """
    req = urllib.request.Request(
        router_url + "/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read()), resp.headers.get(WORKER_HEADER, "?")
    except urllib.error.HTTPError as err:
        return err
    except (urllib.error.URLError, OSError) as exc:
        raise DemoError(f"/generate through the router failed: {exc!r}") from exc


def generate(router_url: str, prompt: str, max_new_tokens: int, timeout_s: float) -> Rollout:
    """One greedy rollout through the router, with the id of the worker that served it."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    served = post_generate(router_url, body, timeout_s)
    if isinstance(served, urllib.error.HTTPError):
        raise DemoError(f"/generate through the router answered {served.code}: {served.read()[:500]!r}") from served
    answer, worker = served
    version = str(answer["meta_info"]["weight_version"])
    return Rollout(text=answer["text"], output_ids=list(answer["output_ids"]), weight_version=version, worker=worker)


class Trainer:
    """Teaches ``policy`` to answer ``prompt`` with ``target`` and keeps the fleet in sync."""

    def __init__(
        self,
        router_url: str,
        admin_key: str,
        policy: TrainablePolicy,
        *,
        prompt: str,
        target: str,
        group_port: int,
        bucket_bytes: int,
        timeout_s: float = 30.0,
    ):
        self.router_url = router_url
        self.client = RouterClient(router_url, admin_key=admin_key)
        self.policy = policy
        self.prompt = prompt
        self.prompt_ids = policy.tokenizer.encode(prompt)
        self.target_ids = policy.tokenizer.encode(target)
        self.timeout_s = timeout_s
        self.plan = BucketPlan.from_named_tensors(policy.tensors, budget_bytes=bucket_bytes)
        self.group = GroupSpec(
            master_address="127.0.0.1", master_port=group_port, join=self._join, leave=self._leave, timeout_s=timeout_s
        )
        self.sender: TrainerWeightSender | None = None

    def _join(self, world_size: int) -> None:
        # The world size comes from the router (1 + every worker's ranks), so the
        # sender is built when a sync asks for it: the first one, and the one after
        # a failed sync that tore the group down.
        self._leave()
        self.sender = TrainerWeightSender(
            master_address=self.group.master_address,
            master_port=self.group.master_port,
            world_size=world_size,
            group_name=self.group.group_name,
            timeout_s=self.timeout_s,
        )
        self.sender.join(cancel=self.group.cancel)  # gives up at once if the router refuses the init

    def _leave(self) -> None:
        """Close the trainer's side of the group (idempotent)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _broadcast(self, index: int) -> None:
        assert self.sender is not None, "the group is joined before the first broadcast"
        self.sender.send_bucket(self.plan, index, self.policy.tensors, load_format=LOAD_FORMAT)

    def rollouts(self, n: int) -> list[Rollout]:
        """``n`` greedy rollouts of the prompt (round-robin across the workers)."""
        return [generate(self.router_url, self.prompt, len(self.target_ids), self.timeout_s) for _ in range(n)]

    def step(self, step: int, n_rollouts: int) -> StepResult:
        """Roll out, train, sync as ``step-<step>``; raises on any failure."""
        rollouts = self.rollouts(n_rollouts)
        loss = self.policy.train_step(self.prompt_ids, self.target_ids)
        expected = self.policy.checksum()
        report = self.client.sync_weights(
            buckets=self.plan.metadata(self.policy.tensors),  # with sizes and checksums, checked by every worker
            broadcast=self._broadcast,
            group=self.group,
            load_format=LOAD_FORMAT,
            weight_version=f"step-{step}",
            expected_checksum=expected,
            timeout_s=self.timeout_s,
            progress=_quiet,
        )
        # sync_weights raises when verification fails; check again so a silently
        # skipped verification cannot pass for a matching fleet.
        ranks = [c for per_worker in report.rank_checksums.values() for c in per_worker]
        if not (report.fleet_identical and report.matches_expected and ranks and set(ranks) == {expected}):
            raise DemoError(f"fleet checksums {report.rank_checksums} do not all equal the trainer's {expected}")
        return StepResult(step=step, rollouts=rollouts, loss=loss, trainer_checksum=expected, sync=report)

    def close(self, *, leave_group: bool) -> None:
        """Leave the weight-update group (telling the workers first when ``leave_group``)."""
        if self.sender is None:
            return
        if leave_group:
            try:
                self.client.destroy_weights_update_group(self.group.group_name)
            except RouterCallError as exc:
                print(f"note: destroy_weights_update_group failed: {exc}")
        self._leave()


def _quiet(stage: str, info: dict) -> None:
    """Progress goes into the step's table row, not the log."""
