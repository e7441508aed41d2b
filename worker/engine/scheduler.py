"""The scheduler: the one thread that owns the model.

Its loop drains a command queue (new requests, aborts, admin operations), then
runs one forward step if there is runnable work, else blocks on the queue for a
short while. Continuous batching: requests join and leave between steps, and
one ``forward_batch`` call mixes prefills and decodes. Admin operations are
plain callables executed on this thread *between* steps, never during a
forward; callers get a ``concurrent.futures.Future``.

Pause states (SGLang semantics):

* ``abort`` — every request held at pause time finishes with
  ``finish_reason`` ``abort`` and its partial output;
* ``retract`` — running requests drop their KV and go back to the front of the
  waiting queue; after continue they recompute prompt + generated tokens and
  complete normally;
* ``in_place`` — running requests stay frozen with their KV.
* ``drain`` (vLLM's ``wait``) — no request is admitted any more, running ones
  run to their end; the scheduler is paused once none is left.

In every mode new requests are queued (not rejected) and nothing is stepped
until ``continue``. A request is *active* when it holds KV computed with the
current weights (running, or frozen in place); waiting and retracted requests
hold none. Generation also stays stopped while weights or KV memory are
released, or while the weights are marked partial.

Methods documented "scheduler thread" must only be called from admin callables.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.engine.model_worker import ModelWorker
from worker.engine.request import FinishReason, ReqState, Request
from worker.engine.results import Paused
from worker.engine.sampling import check_finish, make_generator, sample_batch
from worker.model import SeqInput

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place", "drain")

T = TypeVar("T")


@dataclass
class SchedulerStats:
    """Counters published for ``/server_info``; written by the scheduler thread only."""

    steps: int = 0
    generated_tokens: int = 0
    max_batch_size_seen: int = 0
    last_batch_size: int = 0
    last_gen_throughput: float = 0.0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """One rank's scheduler as ``/server_info`` reports it (an ``internal_states`` entry)."""

    rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    is_paused: bool
    pause_mode: str | None
    effective_max_running_requests_per_dp: int
    memory_usage: dict[str, float]
    """GiB per kind of memory (``weight``)."""
    released_memory: list[str]
    stats: SchedulerStats
    """A copy of the counters, taken with the rest."""

    def to_wire(self) -> dict[str, object]:
        """The JSON edge: SGLang's flat ``internal_states`` entry, the counters beside the rest."""
        return {
            "rank": self.rank,
            "num_running_reqs": self.num_running_reqs,
            "num_waiting_reqs": self.num_waiting_reqs,
            "is_paused": self.is_paused,
            "pause_mode": self.pause_mode,
            "effective_max_running_requests_per_dp": self.effective_max_running_requests_per_dp,
            "memory_usage": self.memory_usage,
            "released_memory": self.released_memory,
            **{f.name: getattr(self.stats, f.name) for f in dataclasses.fields(self.stats)},
        }


class Scheduler:
    """Runs forward steps and admin operations for one rank on one thread."""

    def __init__(
        self,
        worker: ModelWorker,
        *,
        rank: int = 0,
        max_running_requests: int = 32,
        step_delay_s: float = 0.0,
        idle_wait_s: float = 0.25,
    ):
        self.worker = worker
        self.rank = rank
        self.max_running_requests = max(1, max_running_requests)
        self.step_delay_s = step_delay_s
        self.idle_wait_s = idle_wait_s
        self.stats = SchedulerStats()
        self.is_paused = False
        self.pause_mode: str | None = None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._generator = make_generator(worker.device, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"omni-scheduler-{rank}", daemon=True)

    # -- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # -- submissions (any thread) ---------------------------------------------------------
    def submit_request(self, req: Request) -> None:
        self._commands.put(("add", req))

    def submit_admin(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the scheduler thread between steps; its result lands in the Future."""
        fut: Future[T] = Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the scheduler thread is not running"))
            return fut
        self._commands.put(("admin", (fn, fut)))
        return fut

    def submit_abort(self, rid: str | None, *, abort_all: bool = False, message: str = "Aborted") -> Future[list[str]]:
        return self.submit_admin(lambda: self.abort_matching(rid, abort_all=abort_all, message=message))

    # -- read-only views (any thread; a consistent-enough snapshot for reporting) ---------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def internal_state(self) -> SchedulerState:
        return SchedulerState(
            rank=self.rank,
            num_running_reqs=self.num_running,
            num_waiting_reqs=self.num_waiting,
            is_paused=self.is_paused,
            pause_mode=self.pause_mode,
            effective_max_running_requests_per_dp=self.max_running_requests,
            memory_usage=self.worker.memory_usage(),
            released_memory=sorted(self.worker.released_tags),
            stats=dataclasses.replace(self.stats),
        )

    # -- state operations (scheduler thread) ----------------------------------------------
    @property
    def active_request_count(self) -> int:
        """Requests holding KV computed with the current weights (running or frozen)."""
        return len(self._running)

    def abort_matching(self, rid: str | None, *, abort_all: bool = False, message: str = "Aborted") -> list[str]:
        """Abort requests whose rid starts with ``rid`` (SGLang prefix match), or all.

        Running requests leave the batch and free their KV at once. SGLang lets
        them run one more step, so a flush issued right after an abort can fail
        there ("Cache flush failed after updating weights", sglang#12099)."""
        if not abort_all and not rid:
            return []
        return self.abort_where(lambda r: abort_all or r.startswith(rid or ""), message)

    def abort_where(self, matches: Callable[[str], bool], message: str = "Aborted") -> list[str]:
        """Abort the requests whose rid ``matches``; their rids."""
        victims = [r for r in (*self._running, *self._waiting) if matches(r.rid)]
        # Counted first: a state snapshot taken from another thread never shows the requests gone but not counted.
        self.stats.aborted_requests += len(victims)
        for req in victims:
            self._finish(req, FinishReason.aborted(message))
        return [r.rid for r in victims]

    def abort_all(self, message: str = "Aborted") -> list[str]:
        return self.abort_matching(None, abort_all=True, message=message)

    def pause(self, mode: str) -> Paused:
        """Enter a pause mode. Unlike SGLang, ``abort`` mode also marks the
        scheduler paused (SGLang only blocks new requests in its tokenizer); the
        observable behaviour is the same: held requests end as aborted and new
        ones wait until continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; choose from {', '.join(PAUSE_MODES)}")
        aborted: list[str] = []
        retracted = 0
        if mode == "abort":
            aborted = self.abort_all(f"Aborted: generation paused (mode={mode})")
        elif mode == "retract":
            retracted = self.retract_running()
        self.pause_mode = mode
        # Draining: running requests keep stepping; the pause takes hold once they are done.
        self.is_paused = mode != "drain" or not self._running
        return Paused(mode, len(aborted), aborted, num_retracted=retracted, num_frozen=len(self._running))

    def retract_running(self) -> int:
        """Drop the KV of every running request and put it back at the head of the queue, in order."""
        running, self._running = self._running, []
        for req in reversed(running):
            req.drop_kv()
            req.state = ReqState.WAITING
            req.retractions += 1
            self._waiting.appendleft(req)
        self.stats.retracted_requests += len(running)
        return len(running)

    def continue_generation(self, *, empty_cache: bool = False) -> None:
        if empty_cache:
            self.worker.empty_device_cache()
        self.is_paused = False
        self.pause_mode = None

    def flush_cache(self) -> tuple[bool, str]:
        """Free cached KV. Refused while any request is active (it would lose its cache)."""
        if self._running:
            frozen = " (frozen by an in_place pause)" if self.is_paused else ""
            return False, (
                f"cannot flush the cache: {len(self._running)} active request(s){frozen} hold KV cache; "
                "abort them, pause with mode=retract, or wait for them to finish"
            )
        self.worker.empty_device_cache()
        return True, "Cache flushed."

    # -- the loop ----------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """A ``drain`` pause is waiting for running requests to end (new ones are not admitted)."""
        return self.pause_mode == "drain" and not self.is_paused

    def _runnable(self) -> bool:
        if self.is_paused or self.worker.released_tags or self.worker.weights_partial:
            return False
        if self.draining:
            return bool(self._running)
        return bool(self._waiting or self._running)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self._runnable())
                if self._runnable() and not self._stop.is_set():
                    self._step()
                if self.draining and not self._running:
                    self.is_paused = True
            except Exception:
                log.exception("scheduler loop iteration failed")
        self._shutdown()

    def _drain(self, *, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._waiting.append(payload)
        elif kind == "admin":
            fn, fut = payload
            if not fut.set_running_or_notify_cancel():
                return  # the caller gave up before it ran
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _admit(self) -> None:
        while not self.draining and self._waiting and len(self._running) < self.max_running_requests:
            req = self._waiting.popleft()
            remaining = req.params.max_new_tokens - len(req.output_ids)
            if remaining <= 0:
                self._finish(req, FinishReason.at_length(req.params.max_new_tokens))
                continue
            try:
                req.kv = self.worker.new_kv_cache(min(req.total_len + remaining, self.worker.context_len))
                if req.generator is None and req.params.seed is not None:
                    req.generator = make_generator(self.worker.device, req.params.seed)
            except Exception as exc:
                log.exception("cannot admit request %s", req.rid)
                self._finish(req, FinishReason.aborted(f"cannot allocate KV cache: {type(exc).__name__}"))
                continue
            req.state = ReqState.RUNNING
            self._running.append(req)

    def _step(self) -> None:
        self._admit()
        if not self._running:
            return
        batch = list(self._running)
        # Weights and their version change only between steps, on this thread: this step's tokens are all
        # sampled by the weights of this version (in-place frozen requests resume on newer weights here).
        version = self.worker.weight_version
        started = time.perf_counter()
        try:
            logits = self.worker.forward_batch([SeqInput(r.pending_tokens(), r.kv, r.adapter) for r in batch])  # type: ignore[arg-type]
            picks = sample_batch(logits, batch, self._generator)
        except Exception as exc:
            log.exception("forward step failed; aborting %d request(s)", len(batch))
            for req in batch:
                self._finish(req, FinishReason.aborted(f"internal error during generation: {type(exc).__name__}"))
            return
        worker = self.worker
        for req, (token, logprob, top) in zip(batch, picks, strict=True):
            req.append(token, logprob, top, version)
            reason = check_finish(req, token, worker.eos_token_ids, worker.decode, worker.context_len)
            if reason is not None:
                self._finish(req, reason)
            else:
                req.emit(final=False)
        elapsed = time.perf_counter() - started
        stats = self.stats
        stats.steps += 1
        stats.generated_tokens += len(batch)
        stats.last_batch_size = len(batch)
        stats.max_batch_size_seen = max(stats.max_batch_size_seen, len(batch))
        stats.last_gen_throughput = len(batch) / elapsed if elapsed > 0 else 0.0
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.state == ReqState.RUNNING:
            self._running.remove(req)
        elif req.state == ReqState.WAITING:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        else:
            return
        req.drop_kv()
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        self.stats.finished_requests += 1
        req.emit(final=True)

    def _shutdown(self) -> None:
        """Answer everything still queued so no caller waits on a dead thread."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._waiting.append(payload)
            elif kind == "admin":
                _fn, fut = payload
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the worker is shutting down"))
        self.abort_all("Aborted: the worker is shutting down")
