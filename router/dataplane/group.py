"""The weight-update process group: trainer at rank 0, inference ranks after it.

The group is built with the recipe SGLang, OpenRLHF and slime share (SGLang's
``init_custom_process_group``, copied from PyTorch): a TCP rendezvous at
``tcp://master_address:master_port`` whose store is hosted by rank 0 (the
trainer), a store prefixed by the group name, and torch's process-group helper.
A trainer using that recipe interoperates with no change.

Differences from SGLang, all on the failure path:

* the timeout defaults to the budget's ``DEFAULT_GROUP_TIMEOUT_S`` (SGLang leaves torch's
  30 minutes), so a peer that never arrives fails the join with a clear error;
* no default process group is needed: the group is registered in torch's
  world map as its own world (``pg_group_ranks[pg] = {i: i}``) so that
  ``broadcast(src=0, group=pg)`` resolves rank 0 without one;
* a failed or timed-out collective marks the group *broken*: after it the
  sender and receivers are no longer in lockstep, so every later use fails fast
  until the group is destroyed and created again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from router.contract.budget import DEFAULT_GROUP_TIMEOUT_S

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]


class GroupError(RuntimeError):
    """Joining, using or destroying the weight-update group failed."""


def default_backend() -> Backend:
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(eq=False)
class WeightUpdateGroup:
    """One joined weight-update group and whether it is still usable."""

    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    pg: dist.ProcessGroup | None
    broken_reason: str | None = None
    #: Broadcasts posted and not yet seen to complete (a failed or timed-out wait leaves one posted).
    outstanding: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def alive(self) -> bool:
        return self.pg is not None and self.broken_reason is None

    def require_usable(self) -> dist.ProcessGroup:
        """The torch group, or :class:`GroupError` saying why it cannot be used."""
        if self.pg is None:
            raise GroupError(f"weight-update group {self.name!r} was destroyed; call init_weights_update_group first")
        if self.broken_reason is not None:
            raise GroupError(
                f"weight-update group {self.name!r} is broken ({self.broken_reason}); "
                "destroy it and call init_weights_update_group again"
            )
        return self.pg

    def mark_broken(self, reason: str) -> None:
        """Record that a collective failed; the first reason wins."""
        with self._lock:
            if self.broken_reason is None:
                self.broken_reason = reason

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Broadcast from rank 0 into/out of ``tensor``, waiting at most ``timeout_s``.

        The op is issued with ``async_op=True`` and waited with a timeout so
        that NCCL (whose blocking wait has no deadline) and gloo behave alike.
        Any failure marks the group broken.
        """
        work = self.broadcast_async(tensor)
        self.wait(work, timeout_s)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        pg = self.require_usable()
        try:
            work = dist.broadcast(tensor, src=0, group=pg, async_op=True)
        except Exception as exc:
            self.mark_broken(f"broadcast failed: {exc}")
            raise GroupError(f"broadcast on group {self.name!r} failed: {exc}") from exc
        with self._lock:
            self.outstanding += 1
        return work

    def wait(self, work: dist.Work, timeout_s: float) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as exc:
            self.mark_broken(f"broadcast failed: {_short(exc)}")
            raise GroupError(f"broadcast on group {self.name!r} failed: {_short(exc)}") from exc
        if ok is False:
            self.mark_broken(f"broadcast did not finish within {timeout_s:.1f}s")
            raise GroupError(f"broadcast on group {self.name!r} did not finish within {timeout_s:.1f}s")
        with self._lock:
            self.outstanding -= 1

    def destroy(self, timeout_s: float | None = None) -> bool:
        """Leave the group; idempotent, and prompt even while a broadcast is still posted.

        torch's ``destroy_process_group`` runs on a daemon thread and is waited for at most
        ``timeout_s`` (default :data:`DESTROY_TIMEOUT_S`): a backend that hangs while shutting
        down (a peer gone mid-collective) cannot hold up the caller. ``False`` when it did not
        finish in time; the group is gone from this object either way."""
        with self._lock:
            pg, self.pg = self.pg, None
            posted = self.outstanding > 0
        if pg is None:
            return True
        # Held only through this list, so that the last reference drops where we decide.
        holder = [pg]
        del pg
        leave = _Leave(holder, self.name)
        thread = threading.Thread(target=leave.run, name=f"destroy-{self.name}", daemon=True)
        thread.start()
        thread.join(DESTROY_TIMEOUT_S if timeout_s is None else timeout_s)
        if not leave.finish(release_here=not posted):
            log.error(
                "leaving weight-update group %r did not finish within %.0fs; left to a background thread",
                self.name,
                DESTROY_TIMEOUT_S if timeout_s is None else timeout_s,
            )
            return False
        return True


#: How long leaving a group may take (torch's ``destroy_process_group``) before the caller moves on.
DESTROY_TIMEOUT_S = 10.0


class _Leave:
    """``destroy_process_group`` on its own thread; whoever finishes last drops the group's last reference."""

    def __init__(self, holder: list[dist.ProcessGroup], name: str):
        self._holder = holder
        self._name = name
        self._lock = threading.Lock()
        self._done = False
        self._abandoned = False

    def run(self) -> None:
        try:
            dist.destroy_process_group(self._holder[0])
        except Exception as exc:  # a broken group may fail to shut down cleanly; it is gone either way
            log.warning("destroying weight-update group %r: %s", self._name, exc)
            _forget(self._holder[0])
        with self._lock:
            self._done = True
            abandoned = self._abandoned
        if abandoned:
            self._holder.clear()

    def finish(self, *, release_here: bool) -> bool:
        """After the caller's wait: ``True`` if the leave finished (the group is released here, or on a
        daemon thread when a broadcast is still posted); ``False`` if it is still running (it then releases
        the group itself when it ends)."""
        with self._lock:
            if not self._done:
                self._abandoned = True
                return False
        if release_here:
            self._holder.clear()
        else:
            _release_later(self._holder, self._name)
        return True


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until every rank arrives.

    Raises :class:`GroupError` with the cause when the rendezvous or the
    backend's connection set-up does not complete within ``timeout_s``, or as
    soon as ``cancel`` is set (the other ranks will not come: the trainer's
    router refused the init). Call from a thread: never from an asyncio event loop.
    """
    if not group_name:
        raise GroupError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise GroupError(f"rank {rank} is outside world_size {world_size}")
    if timeout_s <= 0:
        raise GroupError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise GroupError("backend 'nccl' needs a CUDA device; this process has none (use 'gloo')")
    if backend not in ("gloo", "nccl"):
        raise GroupError(f"unsupported backend {backend!r}; expected 'gloo' or 'nccl'")
    if group_name in c10d._world.pg_names.values():
        raise GroupError(f"a process group named {group_name!r} already exists in this process; destroy it first")

    with _JOINING_LOCK:
        if group_name in _JOINING:
            raise GroupError(f"an earlier attempt to join {group_name!r} is still running; retry after its timeout")
        _JOINING.add(group_name)
    join = _Join(master_address, master_port, rank, world_size, group_name, backend, timeout_s)
    thread = threading.Thread(target=join.run, name=f"join-{group_name}", daemon=True)
    thread.start()
    # gloo's connection set-up retries on its own and can overrun the store
    # timeout several times over; the caller's bound is enforced here.
    deadline = time.monotonic() + timeout_s + JOIN_GRACE_S
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        if cancel is not None and cancel.is_set():
            break
        thread.join(min(left, CANCEL_POLL_S) if cancel is not None else left)
    return join.result(cancelled=cancel is not None and cancel.is_set())


#: Extra time granted past ``timeout_s`` before a join is abandoned.
JOIN_GRACE_S = 2.0
#: How often a join that may be cancelled looks at its ``cancel`` event.
CANCEL_POLL_S = 0.05
_JOINING: set[str] = set()
_JOINING_LOCK = threading.Lock()


class _Join:
    """One join attempt on its own thread. If the caller stops waiting, a late
    success is destroyed at once, so an abandoned attempt never leaves a group."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ):
        self.args = (master_address, master_port, rank, world_size, group_name, backend, timeout_s)
        self._lock = threading.Lock()
        self._done = False
        self._abandoned = False
        self._group: WeightUpdateGroup | None = None
        self._error: GroupError | None = None

    def run(self) -> None:
        try:
            group, error = _join(*self.args), None
        except GroupError as exc:
            group, error = None, exc
        except Exception as exc:
            group, error = None, GroupError(f"joining failed: {_short(exc)}")
        with self._lock:
            self._done = True
            self._group, self._error = group, error
            abandoned = self._abandoned
        if abandoned and group is not None:
            log.warning("an abandoned join of %r completed late; leaving the group", group.name)
            group.destroy()
        with _JOINING_LOCK:
            _JOINING.discard(self.args[4])

    def result(self, *, cancelled: bool = False) -> WeightUpdateGroup:
        master_address, master_port, rank, world_size, group_name, _backend, timeout_s = self.args
        with self._lock:
            if not self._done:
                self._abandoned = True
                if cancelled:
                    raise GroupError(
                        f"joining weight-update group {group_name!r} was cancelled: the other ranks will not come "
                        "(the init was refused); the attempt ends in the background within its timeout"
                    )
                raise GroupError(
                    f"failed to join weight-update group {group_name!r} at {master_address}:{master_port} as rank "
                    f"{rank} of {world_size} within {timeout_s:.0f}s: the connection set-up did not finish "
                    "(do all ranks agree on world_size?)"
                )
            if self._error is not None:
                raise self._error
            assert self._group is not None
            return self._group


def _join(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> WeightUpdateGroup:
    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{_host_for_url(master_address)}:{master_port}"
    try:
        deadline = time.monotonic() + timeout_s
        if rank != 0:
            # torch's store client retries with its own back-off and can overrun
            # the timeout twice over; wait for the trainer's store ourselves.
            _wait_for_listener(master_address, master_port, timeout_s)
        remaining = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
        base_store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=remaining))
        # The join as a whole keeps to the deadline ...
        base_store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        # The prefix keeps several groups (or other tenants) of one store apart.
        store = c10d.PrefixStore(group_name, base_store)
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=c10d.GroupName(group_name),
            backend_options=None,
            timeout=timeout,
        )
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        # ... but NCCL exchanges its unique id through the store lazily, at the
        # first collective, which may come much later: give it the full timeout.
        base_store.set_timeout(timeout)
    except Exception as exc:
        raise GroupError(
            f"failed to join weight-update group {group_name!r} at {init_method} as rank {rank} of {world_size} "
            f"within {timeout_s:.0f}s: {_short(exc)}"
        ) from exc
    log.info("joined weight-update group %r as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return WeightUpdateGroup(
        name=group_name, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s, pg=pg
    )


def _wait_for_listener(address: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GroupError(f"nothing listens at {address}:{port} (is the trainer's rank 0 up?)")
        try:
            with socket.create_connection((address, port), timeout=min(1.0, remaining)):
                return
        except OSError:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


def _host_for_url(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _short(exc: BaseException, limit: int = 400) -> str:
    """One line of an exception's text: torch appends C++ backtraces we don't want in a reply."""
    text = str(exc).split("Exception raised from", 1)[0]
    text = " ".join(text.split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _release_later(holder: list[dist.ProcessGroup], name: str) -> None:
    """Drop the last reference to a group (the only item of ``holder``) on a daemon thread.

    torch's destructor of a gloo group joins its I/O threads, so it waits for
    any broadcast still posted on it (until its data arrives, the peer leaves or
    the group's timeout passes). A receive abandoned by an abort or a timeout
    must not hold up ``destroy`` (an HTTP call, or shutdown): that wait happens
    here. Only then: a group with nothing posted is released at once, in the
    caller, so that no destructor is left running when the process exits.
    """
    threading.Thread(target=holder.clear, name=f"release-{name}", daemon=True).start()


def _forget(pg: dist.ProcessGroup) -> None:
    """Drop a group from torch's registries when ``destroy_process_group`` failed."""
    for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks, c10d._world.pg_backend_config):
        table.pop(pg, None)
