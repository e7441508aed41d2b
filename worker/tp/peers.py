"""Rank 0's side of tensor parallelism: the follower processes and the one pipe to each.

``omni-worker --tp-size N`` runs N rank processes on one host: this process is
rank 0 (HTTP, the scheduler, every decision) and starts N-1 followers
(:mod:`worker.tp.follower`), then all N join one process group (NCCL on CUDA,
one GPU per rank; gloo on CPU) in which the model's all-reduces run.

Only rank 0's scheduler thread talks to the followers, so the order of forward
steps and admin operations is the same on every rank: a forward step is sent
before rank 0 runs its own (the all-reduces need every rank), an admin
operation is sent, run on rank 0 too, then every follower's result is awaited.
Every wait is bounded; a follower that dies, fails or does not answer in time
raises :class:`TPRankLost` naming it, the worker reports unhealthy, and the
process exits instead of serving with a rank missing.

LoRA adapters (:meth:`TPPeers.load_adapter`): rank 0 gives every adapter version
it placed an id and hands the followers its full tensors under that id before the
version is served; forward steps name each sequence's adapter by that id, and the
id is dropped on the followers once rank 0's own copy is freed (unloaded or
replaced, and the last request running with it ended), so each rank holds exactly
the versions rank 0 holds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from worker.tp.follower import STOP, Forward, LoadAdapter, RankSpec, RankState, RunOp, follower_main, join_group
from worker.tp.ops import RankOp

if TYPE_CHECKING:
    from worker.engine.results import OpResult
    from worker.model.lora import LoadedLora, LoraAdapter

log = logging.getLogger(__name__)

#: How long followers may take to start: import torch, join the group, load their shard.
START_TIMEOUT_S = 300.0
#: How long a follower may take to acknowledge one forward step beyond rank 0's own.
STEP_GRACE_S = 60.0
#: How long the followers may take to place an adapter (read from rank 0's tensors, sliced, copied).
ADAPTER_LOAD_TIMEOUT_S = 120.0
#: The tensor-parallel group's bound on joining and on each collective: a rank that died makes
#: its peers' collectives fail (at once when its sockets close, at this bound at the latest).
TP_TIMEOUT_S = 120.0


def free_local_port() -> int:
    """A port for the group's rendezvous on this host (the ranks all run here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TPRankLost(RuntimeError):
    """A follower rank died, failed or stopped answering: the worker cannot serve without it."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"tensor-parallel rank {rank} is lost: {why}")
        self.rank = rank


class Follower:
    """One follower process and its pipe; ``state`` is what it last reported about itself."""

    def __init__(self, rank: int, process: Any, conn: Connection):
        self.rank = rank
        self.process = process
        self.conn = conn
        self.state = RankState()

    def receive(self, deadline: float, what: str) -> tuple[str, Any]:
        while True:
            if self.conn.poll(min(0.2, max(deadline - time.monotonic(), 0.0))):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError) as exc:
                    raise TPRankLost(self.rank, f"its pipe closed during {what} ({exc!r})") from None
                if kind == "error":
                    raise TPRankLost(self.rank, f"{what} failed there: {payload}")
                return kind, payload
            if not self.process.is_alive():
                raise TPRankLost(self.rank, f"its process exited (code {self.process.exitcode}) during {what}")
            if time.monotonic() >= deadline:
                raise TPRankLost(self.rank, f"no answer to {what} in time")


class TPPeers:
    """The followers of this rank-0 process."""

    def __init__(self, followers: list[Follower]):
        self.followers = followers
        self.lost: TPRankLost | None = None
        self._next_seq = 0
        self._opened: list[tuple[int, int]] = []
        self._dropped: list[int] = []
        self._lock = threading.Lock()
        # Rank 0's adapter versions the followers hold, by id. Drops come from finalizers, which may run in any
        # thread at any point (the cyclic GC included, even inside ``_lock``): SimpleQueue.put is safe there.
        self._adapter_ids: weakref.WeakKeyDictionary[LoadedLora, int] = weakref.WeakKeyDictionary()
        self._next_adapter = 0
        self._dropped_adapters: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._closing = False
        self._on_lost: Callable[[TPRankLost], None] | None = None

    @property
    def size(self) -> int:
        return 1 + len(self.followers)

    @classmethod
    def start(cls, spec: RankSpec) -> tuple[TPPeers, Any]:
        """Start ranks ``1 .. size-1``, join the group as rank 0, wait until every follower loaded its shard.

        Returns the peers and rank 0's handle to the group (for the model)."""
        ctx = mp.get_context("spawn")
        followers = []
        for rank in range(1, spec.size):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=follower_main, args=(child, replace(spec, rank=rank)), name=f"omni-tp-{rank}", daemon=True
            )
            process.start()
            child.close()
            followers.append(Follower(rank, process, parent))
        peers = cls(followers)
        try:
            tp = join_group(spec)
            deadline = time.monotonic() + START_TIMEOUT_S
            for f in followers:
                kind, payload = f.receive(deadline, "start-up")
                if kind != "ready":
                    raise TPRankLost(f.rank, f"it could not start: {payload}")
                f.state = payload
        except BaseException:
            peers.close()
            raise
        log.info("tensor parallelism: %d ranks ready (%s)", spec.size, spec.backend)
        return peers, tp

    def watch(self, on_lost: Callable[[TPRankLost], None], interval_s: float = 0.5) -> None:
        """Call ``on_lost`` once when a rank is lost: found by an exchange, or by a daemon thread that
        notices a follower's death even while nothing runs."""
        self._on_lost = on_lost

        def loop() -> None:
            while self.lost is None and not self._closing:
                for f in self.followers:
                    if not f.process.is_alive():
                        self._declare(TPRankLost(f.rank, f"its process exited (code {f.process.exitcode})"))
                time.sleep(interval_s)

        threading.Thread(target=loop, name="tp-watchdog", daemon=True).start()

    # -- sequences -------------------------------------------------------------------------------
    def open_sequence(self, capacity: int) -> int:
        """A new sequence's id; its KV cache is opened on the followers with the next forward step."""
        with self._lock:
            self._next_seq += 1
            self._opened.append((self._next_seq, capacity))
            return self._next_seq

    def drop_sequence(self, seq: int) -> None:
        """Called when rank 0's KV cache of ``seq`` is freed (from any thread)."""
        with self._lock:
            self._dropped.append(seq)

    # -- scheduler thread ------------------------------------------------------------------------
    def send_forward(self, batch: list[tuple[int, list[int], LoadedLora | None]]) -> None:
        """Send one step: each sequence's id, new tokens and adapter (named by the id the followers hold it by).
        An adapter the followers were never given fails the step here, before anything is sent."""
        steps = [(seq, tokens, self._adapter_id(adapter)) for seq, tokens, adapter in batch]
        with self._lock:
            step = Forward(
                opened=self._opened, dropped=self._dropped, batch=steps, dropped_adapters=self._take_dropped_adapters()
            )
            self._opened, self._dropped = [], []
        self._send(step, "a forward step")

    def await_forward(self) -> None:
        deadline = time.monotonic() + STEP_GRACE_S
        for f in self.followers:
            self._guard(lambda f=f: f.receive(deadline, "a forward step"))

    def send_op(self, action: str, op: RankOp) -> None:
        self._send(RunOp(action, op), action)

    def send_ops(self, action: str, ops: list[RankOp]) -> None:
        """One operation per follower, in rank order (each its own rank in a group, say)."""
        if len(ops) != len(self.followers):
            raise ValueError(f"{len(ops)} operations for {len(self.followers)} followers")
        self._send_each([RunOp(action, op) for op in ops], action)

    def await_op(self, action: str, timeout_s: float) -> list[OpResult[Any]]:
        """Each follower's ``OpResult`` (in rank order); its state snapshot is kept."""
        deadline = time.monotonic() + timeout_s
        results: list[OpResult[Any]] = []
        for f in self.followers:
            _, payload = self._guard(lambda f=f: f.receive(deadline, action))
            result, f.state = payload
            results.append(result)
        return results

    def load_adapter(
        self, placed: LoadedLora, adapter: LoraAdapter, *, max_rank: int, timeout_s: float = ADAPTER_LOAD_TIMEOUT_S
    ) -> list[OpResult[Any]]:
        """Have every follower place its slice of ``adapter``, the version rank 0 placed as ``placed`` (not
        served yet); each follower's result, in rank order. Only when every one succeeded may forward steps
        name ``placed``: a refused load leaves it unknown to the followers, and any that placed it drop it
        with the next message. A follower lost meanwhile raises :class:`TPRankLost` (the worker fails)."""
        with self._lock:
            self._next_adapter += 1
            adapter_id = self._next_adapter
        action = f"loading LoRA adapter {placed.name!r}"
        message = LoadAdapter(
            adapter_id,
            placed.name,
            placed.version,
            max_rank,
            adapter.on_cpu(),
            dropped_adapters=self._take_dropped_adapters(),
        )
        try:
            self._send(message, action)
        except TypeError:
            for dropped in message.dropped_adapters:  # sent to no follower: they go with the next message
                self._dropped_adapters.put(dropped)
            raise
        results = self.await_op(action, timeout_s)
        if all(r.success for r in results):
            self._adapter_ids[placed] = adapter_id
            # Rank 0's copy is freed once unloaded or replaced and no request runs with it: so are the followers'.
            weakref.finalize(placed, self._dropped_adapters.put, adapter_id)
        else:
            self._dropped_adapters.put(adapter_id)
        return results

    def _adapter_id(self, adapter: LoadedLora | None) -> int | None:
        if adapter is None:
            return None
        adapter_id = self._adapter_ids.get(adapter)
        if adapter_id is None:
            raise RuntimeError(
                f"LoRA adapter {adapter.name!r} version {adapter.version} was never placed on the follower ranks"
            )
        return adapter_id

    def _take_dropped_adapters(self) -> list[int]:
        dropped = []
        while True:
            try:
                dropped.append(self._dropped_adapters.get_nowait())
            except queue.Empty:
                return dropped

    def _send(self, message: Any, what: str) -> None:
        self._send_each([message] * len(self.followers), what)

    def _send_each(self, messages: list[Any], what: str) -> None:
        """``messages[i]`` to follower ``i``; every one is pickled before any is sent, so a message that
        cannot be pickled reaches no follower (one shared message is pickled once)."""
        self.check()
        pickled: dict[int, bytes] = {}
        try:
            for m in messages:
                if id(m) not in pickled:
                    pickled[id(m)] = bytes(ForkingPickler.dumps(m))
        except Exception as exc:
            raise TypeError(f"{what} cannot be sent to the follower ranks: {exc}") from exc
        for f, m in zip(self.followers, messages, strict=True):
            try:
                f.conn.send_bytes(pickled[id(m)])
            except (OSError, ValueError) as exc:
                self._lose(TPRankLost(f.rank, f"cannot send {what}: {exc!r}"))

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except TPRankLost as exc:
            self._lose(exc)

    def _lose(self, exc: TPRankLost) -> None:
        self._declare(exc)
        raise exc

    def _declare(self, exc: TPRankLost) -> None:
        """The first loss is final: logged once, and the owner told once (it stops the worker)."""
        with self._lock:
            first = self.lost is None and not self._closing
            if first:
                self.lost = exc
        if first:
            log.error("%s; this worker cannot serve any more", exc)
            if self._on_lost is not None:
                self._on_lost(exc)

    def check(self) -> None:
        lost = self.lost
        if lost is not None:
            raise lost
        for f in self.followers:
            if not f.process.is_alive():
                self._lose(TPRankLost(f.rank, f"its process exited (code {f.process.exitcode})"))

    @property
    def alive(self) -> bool:
        return self.lost is None and all(f.process.is_alive() for f in self.followers)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every follower (bounded: terminate, then kill, what does not stop in time)."""
        self._closing = True
        for f in self.followers:
            try:
                f.conn.send(STOP)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for f in self.followers:
            f.process.join(max(deadline - time.monotonic(), 0.1))
            if f.process.is_alive():
                f.process.terminate()
                f.process.join(2.0)
            if f.process.is_alive():
                f.process.kill()
            f.conn.close()
