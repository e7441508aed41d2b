"""The weight-update groups the router built, and whether the fleet still matches them.

A weight-update group has a fixed world size: the trainer and exactly the
workers that joined it. When the fleet changes after the group was built (a
worker is added by ``POST /workers`` or discovery, removed, declared dead, or
its process restarted and so left the group), a broadcast on that group could
not reach the newcomer and would wait for ranks that are gone. So the router
remembers, per group, which worker processes joined it (worker id → instance),
and refuses an update on a group whose membership no longer matches the fleet
with 409 naming the change, before anything is fenced or broadcast. The trainer
rebuilds the group (destroy, init with the new world size); ``GET
/get_world_size`` says whether each group still matches.

Records are ``weight_groups.json`` in the router's state store (``--state-dir``,
written atomically off the event loop; :mod:`router.gateway.state`), so a router
restart keeps refusing stale groups. A group the router
has no record of (built before it ran without a state dir) is not judged here:
the workers decide, and a worker outside it refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from router.contract.base import WireRequest
from router.contract.errors import Conflict
from router.contract.fleet import GroupMembership, RankAssignment
from router.contract.weight_sync import DEFAULT_GROUP_NAME, names_a_group
from router.gateway.fleet.registry import Worker
from router.gateway.state.durable import DurableRecord, as_record

log = logging.getLogger(__name__)

GROUPS_FILE = "weight_groups.json"

GroupDialect = Literal["sglang", "vllm"]


class GroupMember(BaseModel):
    """One worker process in a group: its ranks, and the process that joined."""

    rank: RankAssignment
    instance_id: str | None


class GroupRecord(BaseModel):
    world_size: int
    created_at: float
    members: list[GroupMember]
    dialect: GroupDialect = "sglang"
    """Which init built it: SGLang's ``/init_weights_update_group`` or vLLM's ``/init_weight_transfer_engine``
    (vLLM's updates name no group: they go over the weight-transfer group the last vLLM init built)."""

    def instances(self) -> dict[str, str | None]:
        return {m.rank.worker: m.instance_id for m in self.members}


class _Records(BaseModel):
    groups: dict[str, GroupRecord] = Field(default_factory=dict)


def group_name_of(request: WireRequest) -> str:
    """The group a request is sent over (SGLang's default name when it names none)."""
    return request.group_name if names_a_group(request) else DEFAULT_GROUP_NAME


def membership_changes(record: GroupRecord, targets: Sequence[Worker]) -> list[str]:
    """How the live fleet differs from the group's members (empty when it matches)."""
    joined = record.instances()
    now = {w.id: w for w in targets}
    changes = [f"{wid} joined the fleet" for wid in now if wid not in joined]
    for wid, instance in joined.items():
        worker = now.get(wid)
        if worker is None:
            changes.append(f"{wid} left the fleet (removed or dead)")
        elif _restarted(instance, worker):
            changes.append(f"{wid} restarted (its new process is not in the group)")
    return changes


def _restarted(joined_instance: str | None, worker: Worker) -> bool:
    """Whether ``worker`` runs another process than the one that joined (unknown on either side: no)."""
    return joined_instance is not None and worker.instance_id is not None and worker.instance_id != joined_instance


class WeightGroups:
    """Group records by name, with the rule that refuses updates on a group the fleet outgrew."""

    def __init__(self, state: DurableRecord | Path | None):
        self._stored = as_record(state, GROUPS_FILE)
        self._records = self._load()

    def reload(self) -> None:
        """Read the records again (blocking: a new leader takes over what the previous one wrote)."""
        self._records = self._load()

    def _load(self) -> _Records:
        try:
            data = self._stored.load()
            return _Records() if data is None else _Records.model_validate_json(data)
        except (OSError, ValueError, ValidationError) as exc:
            # Without the record every group is unknown: the workers decide, as for a group built elsewhere.
            log.error(
                "weight group record in %s is unreadable (%s); groups are not checked until rebuilt",
                self._stored.location,
                exc,
            )
            return _Records()

    def get(self, name: str) -> GroupRecord | None:
        return self._records.groups.get(name)

    def check(self, name: str, targets: Sequence[Worker]) -> None:
        """Raise 409 when the fleet no longer matches group ``name`` (before anything is touched)."""
        record = self.get(name)
        if record is None:
            return
        changes = membership_changes(record, targets)
        if changes:
            raise Conflict(
                f"weight-update group {name!r} no longer matches the fleet: {'; '.join(changes)}. It was built "
                f"with world_size {record.world_size}; destroy it and initialize it again (GET /get_world_size "
                "gives the new world size). Nothing was broadcast",
                group_changes=changes,
            )

    def members_among(self, name: str, targets: Sequence[Worker]) -> list[Worker]:
        """The live workers that joined group ``name`` (all of ``targets`` when it is unknown), each in the process
        that joined: a member that restarted since holds no group (its new process would refuse a leave)."""
        record = self.get(name)
        if record is None:
            return list(targets)
        joined = record.instances()
        return [w for w in targets if w.id in joined and not _restarted(joined[w.id], w)]

    def views(self, targets: Sequence[Worker]) -> list[GroupMembership]:
        out = []
        for name, record in sorted(self._records.groups.items()):
            changes = membership_changes(record, targets)
            out.append(
                GroupMembership(
                    group_name=name,
                    world_size=record.world_size,
                    members=[m.rank for m in record.members],
                    matches_fleet=not changes,
                    changes=changes,
                )
            )
        return out

    def latest(self, dialect: GroupDialect) -> str | None:
        """The name of the group ``dialect``'s init built last, if the router knows one."""
        records = [(r.created_at, name) for name, r in self._records.groups.items() if r.dialect == dialect]
        return max(records)[1] if records else None

    async def built(
        self,
        name: str,
        world_size: int,
        ranks: Iterable[RankAssignment],
        targets: Sequence[Worker],
        *,
        dialect: GroupDialect = "sglang",
    ) -> None:
        """Group ``name`` now holds exactly ``targets`` (in the processes probed before they joined)."""
        instances = {w.id: w.instance_id for w in targets}
        members = [GroupMember(rank=r, instance_id=instances.get(r.worker)) for r in ranks]
        self._records.groups[name] = GroupRecord(
            world_size=world_size, created_at=time.time(), members=members, dialect=dialect
        )
        await self._save()

    async def dropped(self, name: str) -> None:
        """Group ``name`` was destroyed or failed to form: forget it."""
        if self._records.groups.pop(name, None) is not None:
            await self._save()

    async def _save(self) -> None:
        # The in-memory records still decide whether or not the store takes them now.
        await self._stored.save(self._records.model_dump_json(indent=1).encode())
