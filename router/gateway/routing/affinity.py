"""Session affinity: every turn of one conversation goes to the same worker, which keeps its prefix cached.

A session's key comes from the request (:func:`session_key`): the ``X-Session-Id`` header, else the
SGLang Model Gateway's ``X-SMG-Routing-Key``, else the lineage of the caller's ``rid`` (the rid with
its per-turn ``_t<n>`` and per-retry ``_r<n>`` suffixes stripped, as ``smg`` derives it). A request
without one follows the load-balancing policy and costs nothing here.

:class:`SessionAffinity` maps a key to a worker over the candidates the proxy gives it (already only
the eligible ones: routable, not tried, inside the weight-version policy). Invariants:

- **Placement is deterministic.** A new key goes to the first worker in its rendezvous (highest
  random weight) ranking whose pin count is below ``ceil((1+ε)·mean)``, the mean taken over the
  candidates with this key counted; such a worker always exists, so no worker ever holds more than
  that bound through placement. The ranking hashes the key and the worker ids with BLAKE2b, never
  Python's per-process ``hash``, so every router restart ranks alike. With data-plane processes
  the control process's table is the only one that places sessions (the data planes ask it,
  :class:`~router.gateway.data_planes.messages.Place`); a data plane's own table places a session
  only when the control process does not answer in time.
- **A pin moves, and stays moved.** A pin names its worker and a second candidate (the next
  eligible worker in the ranking). When the pinned worker is not among the candidates (fenced,
  unhealthy, pending, removed, out of the version policy, or already tried by a retry) the session
  goes to its second candidate, else to a fresh bounded placement, and that worker *becomes* the
  pin: the session does not bounce back when the old worker returns.
- **Memory is bounded.** The table is keyed by the key's 64-bit BLAKE2b digest (:func:`session_row`:
  a long ``rid`` costs no more than a short one, and every process names a row alike) and
  holds at most ``max_sessions`` pins. A pin lives ``ttl_s`` past its last use; every use moves it
  to the end of the table, so the table is in expiry order and expired pins are dropped from its
  front, lazily, on each call; past the cap the least recently used goes.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import Worker
from router.gateway.metrics import AffinityStats

SESSION_ID_HEADER = "X-Session-Id"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The SGLang Model Gateway's session header, honoured so a client written for ``smg`` keeps its sessions."""

_LINEAGE_SUFFIXES = re.compile(r"(?:_[tr][0-9]+)+\Z")
_MASK64 = (1 << 64) - 1


def rid_lineage(rid: object) -> str | None:
    """The session a caller's rid belongs to: ``abc_t3_r1`` → ``abc``. Trailing ``_t<n>`` and
    ``_r<n>`` are stripped in any order and number; anything else (``x_t``) is kept as is. A rid
    that is not a non-empty string (a batch's list, a number) names no session."""
    if not isinstance(rid, str) or not rid:
        return None
    stem = _LINEAGE_SUFFIXES.sub("", rid)
    return stem or rid  # a rid that is all suffix (``_t1``) is its own session


def session_key(header: Callable[[str], str | None], body: Mapping[str, Any] | None) -> str | None:
    """The request's session key, or ``None``. ``header`` reads a request header; ``body`` is the caller's JSON object as the proxy
    parsed it (``None`` when it parsed none); the OpenAI ``user`` field is deliberately not a key:
    it names an end user, who runs many conversations at once, and RL clients often send one
    fixed value for a whole run, which would put every request on one worker."""
    key = header(SESSION_ID_HEADER) or header(ROUTING_KEY_HEADER)
    if key:
        return key
    return None if body is None else rid_lineage(body.get("rid"))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def session_row(key: str) -> int:
    """The row that names a session in every process's table (and what ranks workers for it)."""
    return _digest(key)


@lru_cache(maxsize=4096)
def _worker_digest(worker_id: str) -> int:
    return _digest(worker_id)


def _score(key_digest: int, worker_id: str) -> int:
    """The rendezvous weight of a worker for a key: splitmix64's finalizer over both digests, so
    every worker's weights for different keys are independent."""
    z = (key_digest ^ _worker_digest(worker_id)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class _Pin:
    worker: str
    second: str | None
    expires: float


class SessionAffinity:
    """The session table of one process (see the module docstring)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        load_factor: float,
        max_sessions: int,
        stats: AffinityStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ttl_s = ttl_s
        self._load_factor = load_factor
        self._max_sessions = max_sessions
        self._stats = stats if stats is not None else AffinityStats()
        self._clock = clock
        self._pins: OrderedDict[int, _Pin] = OrderedDict()
        self._load: dict[str, int] = {}
        """Pins per worker id; a worker with none is absent."""
        self.on_forget: Callable[[int], None] | None = None
        """Told each row whose pin moved or was evicted (not one that expired): data planes that keep a copy
        of the pins drop it (:mod:`router.gateway.data_planes.session_pins`)."""

    @classmethod
    def from_config(cls, config: RouterConfig, stats: AffinityStats) -> SessionAffinity:
        return cls(
            ttl_s=config.session_affinity_ttl_s,
            load_factor=config.session_affinity_load_factor,
            max_sessions=config.session_affinity_max_sessions,
            stats=stats,
        )

    def __len__(self) -> int:
        return len(self._pins)

    def pins_on(self, worker_id: str) -> int:
        return self._load.get(worker_id, 0)

    def pinned_worker(self, key: str) -> str | None:
        """The worker ``key`` is pinned to now (an expired pin counts as none); does not refresh it."""
        pin = self._pins.get(session_row(key))
        return None if pin is None or pin.expires <= self._clock() else pin.worker

    def second_candidate(self, key: str) -> str | None:
        """Where ``key`` goes when its pinned worker is not eligible, if it is; does not refresh it."""
        pin = self._pins.get(session_row(key))
        return None if pin is None or pin.expires <= self._clock() else pin.second

    def choose(self, key: str, candidates: Sequence[Worker], *, retry: bool = False) -> Worker:
        """The worker for ``key`` among ``candidates`` (never empty); remembers the choice.

        ``retry``: the candidates leave out workers this request already failed on, so a move is
        counted as ``retry`` rather than ``not_eligible``; the session stays where it is served."""
        now = self._clock()
        self._expire(now)
        row = session_row(key)
        pin = self._pins.get(row)
        if pin is not None:
            for worker in candidates:
                if worker.id == pin.worker:
                    pin.expires = now + self._ttl_s
                    self._pins.move_to_end(row)
                    self._stats.hits += 1
                    return worker
        ranked = sorted(candidates, key=lambda w: _score(row, w.id), reverse=True)
        bound = self._bound(candidates)
        target = None
        if pin is not None and pin.second is not None:
            target = next((w for w in candidates if w.id == pin.second), None)
        if target is None:
            # Some worker is below the bound (else the pins would outnumber the mean): this finds one.
            target = next((w for w in ranked if self._load.get(w.id, 0) < bound), ranked[0])
        second = self._second(ranked, target, bound)
        if pin is None:
            self._stats.new_pins += 1
            self._pins[row] = _Pin(target.id, second, now + self._ttl_s)
        else:
            self._stats.reassigned("retry" if retry else "not_eligible")
            self._unload(pin.worker)
            if self.on_forget is not None:
                self.on_forget(row)
            pin.worker, pin.second, pin.expires = target.id, second, now + self._ttl_s
            self._pins.move_to_end(row)
        self._load[target.id] = self._load.get(target.id, 0) + 1
        while len(self._pins) > self._max_sessions:
            evicted_row, evicted = self._pins.popitem(last=False)
            self._unload(evicted.worker)
            if self.on_forget is not None:
                self.on_forget(evicted_row)
        self._stats.pinned = len(self._pins)
        return target

    def touch(self, rows: Iterable[int]) -> None:
        """Sessions served from a data plane's copy of their pin: each pin lives ``ttl_s`` from now, as a hit's does."""
        expires = self._clock() + self._ttl_s
        pins = self._pins
        for row in rows:
            pin = pins.get(row)
            if pin is not None:
                pin.expires = expires
                pins.move_to_end(row)

    def _bound(self, candidates: Sequence[Worker]) -> int:
        """ceil((1+ε)·mean) over ``candidates``, the key being placed counted in the mean."""
        total = sum(self._load.get(w.id, 0) for w in candidates) + 1
        # Rounded first, so that e.g. 1.25·200/4 is 62.5 and not a hair above a whole number.
        return math.ceil(round((1 + self._load_factor) * total / len(candidates), 9))

    def _second(self, ranked: Sequence[Worker], first: Worker, bound: int) -> str | None:
        """The failover candidate: the next worker in the ranking below the load bound, else the next."""
        others = [w for w in ranked if w.id != first.id]
        if not others:
            return None
        return next((w.id for w in others if self._load.get(w.id, 0) < bound), others[0].id)

    def _unload(self, worker_id: str) -> None:
        left = self._load.get(worker_id, 0) - 1
        if left > 0:
            self._load[worker_id] = left
        else:
            self._load.pop(worker_id, None)

    def _expire(self, now: float) -> None:
        pins = self._pins
        while pins:
            digest, pin = next(iter(pins.items()))
            if pin.expires > now:
                break
            del pins[digest]
            self._unload(pin.worker)
        self._stats.pinned = len(pins)
