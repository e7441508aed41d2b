"""The weight-update groups this worker has joined: rank 0 and, at tp_size > 1, its follower ranks.

Invariants:

- A name is in the table once every rank of this worker joined the group; while a join runs
  the name is reserved (``joining``), so a second init of the same name is refused at once.
- Every TP rank joins at ``rank_offset + tp_rank``, all at once: the rendezvous needs them all.
  A join that fails on any rank leaves no rank in the group (rank 0 and the followers leave).
- The backend defaults to NCCL on a CUDA worker, gloo otherwise.
- Joins block for up to their timeout, so they run on the caller's threads (``in_thread``),
  never on the event loop; at shutdown ``closing`` is set and a rendezvous in progress gives up.
- The table knows nothing about updates: whoever removes a group (:meth:`GroupTable.pop`) first
  stops what receives on it, then calls :meth:`GroupTable.leave`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from router.contract.budget import HOP_MARGIN_S
from router.contract.weight_sync import InitWeightsUpdateGroupRequest, WeightSyncResponse
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from worker.ranks import Stage
from worker.tp import transfer as tp_transfer

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Runs a blocking call on the owner's threads.
InThread = Callable[[Callable[[], T]], Awaitable[T]]

#: How long a follower rank may take to leave a group.
LEAVE_WAIT_S = 10.0


class GroupTable:
    """The joined groups by name, with init (every rank), adopt (a rendezvous of its own) and leave."""

    def __init__(
        self,
        stage: Stage,
        *,
        default_backend: str,
        in_thread: InThread[Any],
        closing: threading.Event,
        group_timeout_s: float,
    ):
        self._stage = stage
        self._default_backend = default_backend
        self._in_thread = in_thread
        self._closing = closing
        self.group_timeout_s = group_timeout_s
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._joining: set[str] = set()

    def get(self, name: str) -> WeightUpdateGroup | None:
        return self._groups.get(name)

    def pop(self, name: str) -> WeightUpdateGroup | None:
        """Take ``name`` out of the table (the caller then stops its receive and :meth:`leave` s it)."""
        return self._groups.pop(name, None)

    def _taken(self, name: str) -> bool:
        return name in self._groups or name in self._joining

    async def init(self, req: InitWeightsUpdateGroupRequest) -> WeightSyncResponse:
        """Join ``req``'s group on every TP rank of this worker, or leave it everywhere."""
        name = req.group_name
        if self._taken(name):
            return _fail(
                f"Failed to initialize custom process group: group {name!r} already exists; destroy it first.",
                join_attempted=False,
            )
        stage = self._stage
        if req.rank_offset + stage.tp_size > req.world_size:
            return _fail(
                f"Failed to initialize custom process group: this worker's {stage.tp_size} rank(s) from rank_offset "
                f"{req.rank_offset} do not fit in world_size {req.world_size}.",
                join_attempted=False,
            )
        backend = req.backend or self._default_backend
        timeout_s = req.timeout_s or self.group_timeout_s
        self._joining.add(name)
        try:
            leader = self._in_thread(
                partial(
                    init_weight_update_group,
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank=req.rank_offset,
                    world_size=req.world_size,
                    group_name=name,
                    backend=backend,
                    timeout_s=timeout_s,
                )
            )
            joins = [
                partial(
                    tp_transfer.join,
                    name=name,
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank=req.rank_offset + r,
                    world_size=req.world_size,
                    backend=backend,
                    timeout_s=timeout_s,
                )
                for r in range(1, stage.tp_size)
            ]
            followers = stage.followers("init_weights_update_group", joins, timeout_s + HOP_MARGIN_S)
            joined, follower_results = await asyncio.gather(leader, followers, return_exceptions=True)
        finally:
            self._joining.discard(name)
        failures = _join_failures(joined, follower_results)
        if failures:
            if isinstance(joined, WeightUpdateGroup):
                await self._in_thread(joined.destroy)
            await self._followers_leave(name)
            return _fail(f"Failed to initialize custom process group: {failures}.", join_attempted=True)
        assert isinstance(joined, WeightUpdateGroup)
        self._groups[name] = joined
        return WeightSyncResponse(
            success=True, message="Succeeded to initialize custom process group.", join_attempted=True
        )

    async def adopt(self, name: str, join: Callable[[threading.Event], WeightUpdateGroup]) -> WeightSyncResponse:
        """A group joined by a rendezvous of its own (vLLM's NCCL engine): ``join(cancel)`` blocks, so
        it runs on a thread, bounded by its own timeout and given up when the worker shuts down
        (``cancel`` is set); at tp_size 1 only (no follower joins with it)."""
        if self._taken(name):
            return _fail(f"group {name!r} already exists; destroy it first.", join_attempted=False)
        if self._stage.tp_size != 1:
            return _fail("this rendezvous is served at tp_size 1 only", join_attempted=False)
        self._joining.add(name)
        try:
            group = await self._in_thread(partial(join, self._closing))
        except GroupError as exc:
            return _fail(f"Failed to initialize the weight-transfer group: {exc}.", join_attempted=True)
        finally:
            self._joining.discard(name)
        if self._closing.is_set():  # joined just as the worker began to shut down: leave at once
            await self._in_thread(group.destroy)
            return _fail("the worker is shutting down", join_attempted=True)
        self._groups[name] = group
        return WeightSyncResponse(success=True, message="Succeeded to initialize the group.", join_attempted=True)

    async def leave(self, group: WeightUpdateGroup) -> None:
        """Rank 0 and the follower ranks leave ``group`` (already out of the table)."""
        await self._in_thread(group.destroy)
        await self._followers_leave(group.name)

    async def _followers_leave(self, name: str) -> None:
        await self._stage.followers(
            "destroy_weights_update_group", partial(tp_transfer.destroy, name=name), LEAVE_WAIT_S
        )

    async def close(self) -> None:
        """Worker shutdown: rank 0 leaves every group (bounded: a leave that hangs is abandoned and logged)."""
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            if await self._in_thread(group.destroy):
                log.info("shutdown: left weight-update group %r (rank %d/%d)", group.name, group.rank, group.world_size)


def group_note(group: WeightUpdateGroup) -> str:
    """What the caller must do with ``group`` before the next update, if anything."""
    if group.pg is None:
        return f" Group {group.name!r} was destroyed: call /init_weights_update_group before the next update."
    if group.broken_reason is not None:
        return (
            f" Group {group.name!r} is out of step with the trainer ({group.broken_reason}): destroy it and call "
            "/init_weights_update_group again before the next update."
        )
    return ""


def _join_failures(leader: object, followers: object) -> str:
    """Why a group init failed on some rank ('' when every rank joined)."""
    problems = []
    if isinstance(leader, BaseException):
        problems.append(f"rank 0: {leader}")
    if isinstance(followers, BaseException):
        problems.append(f"follower ranks: {followers}")
    elif isinstance(followers, list):
        problems += [f"rank {i + 1}: {r.message}" for i, r in enumerate(followers) if not r.success]
    return "; ".join(problems)


def _fail(message: str, **fields: Any) -> WeightSyncResponse:
    return WeightSyncResponse(success=False, message=message, **fields)
