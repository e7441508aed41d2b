"""Session affinity as a pure table (router/gateway/routing/affinity.py): placement, load bound,
failover that sticks, TTL and LRU bounds, and how a request's session key is read; and a data
plane's copies of the control process's pins (router/gateway/data_planes/session_pins.py). No HTTP."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import pytest

from router.gateway.config import RouterConfig
from router.gateway.data_planes.messages import TO_CONTROL, Place
from router.gateway.data_planes.session_pins import PLACE_TIMEOUT_S, SessionPins
from router.gateway.fleet.registry import Worker
from router.gateway.metrics import AffinityStats
from router.gateway.routing.affinity import (
    ROUTING_KEY_HEADER,
    SESSION_ID_HEADER,
    SessionAffinity,
    rid_lineage,
    session_key,
    session_row,
)

EPSILON = 0.25


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int = 4) -> list[Worker]:
    return [Worker(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", health="healthy") for i in range(n)]


def table(
    *, ttl_s: float = 600.0, max_sessions: int = 100_000, clock: FakeClock | None = None
) -> tuple[SessionAffinity, AffinityStats]:
    stats = AffinityStats()
    affinity = SessionAffinity(
        ttl_s=ttl_s,
        load_factor=EPSILON,
        max_sessions=max_sessions,
        stats=stats,
        clock=clock if clock is not None else FakeClock(),
    )
    return affinity, stats


def bound(sessions: int, workers: int) -> int:
    return math.ceil((1 + EPSILON) * sessions / workers)


def test_turns_of_a_session_stay_on_its_worker_and_pins_respect_the_load_bound() -> None:
    workers = fleet(4)
    affinity, stats = table()
    sessions = [f"rollout-{i}" for i in range(200)]
    first: dict[str, str] = {}
    on_pin = 0
    turns = [(s, t) for t in range(5) for s in sessions]
    random.Random(7).shuffle(turns)  # turns of different sessions interleave, as in a batch of rollouts
    for session, _turn in turns:
        served = affinity.choose(session, workers).id
        pinned = first.setdefault(session, served)
        on_pin += served == pinned
    assert on_pin / len(turns) >= 0.99
    assert len(affinity) == 200
    load = Counter(first.values())
    assert max(load.values()) <= bound(200, 4), load
    assert all(affinity.pins_on(w.id) == load[w.id] for w in workers)
    assert stats.new_pins == 200 and stats.hits == 800 and stats.reassignments == {}
    assert stats.pinned == 200


def test_placement_is_deterministic_across_tables() -> None:
    """Two tables (a restarted router, a data plane placing on its own) given the same eligible set place alike."""
    workers = fleet(4)
    one, _ = table()
    other, _ = table()
    keys = [f"k{i}" for i in range(50)]
    assert [one.choose(k, workers).id for k in keys] == [other.choose(k, list(reversed(workers))).id for k in keys]


def test_zero_load_factor_balances_exactly() -> None:
    workers = fleet(4)
    affinity = SessionAffinity(ttl_s=60, load_factor=0.0, max_sessions=1000, clock=FakeClock())
    for i in range(100):
        affinity.choose(f"s{i}", workers)
    assert [affinity.pins_on(w.id) for w in workers] == [25, 25, 25, 25]


@pytest.mark.parametrize("leaves", ["fenced", "removed"])
def test_sessions_of_a_worker_that_leaves_move_to_their_second_candidate_and_stay(leaves: str) -> None:
    workers = fleet(4)
    affinity, stats = table()
    sessions = [f"s{i}" for i in range(100)]
    before = {s: affinity.choose(s, workers).id for s in sessions}
    gone = workers[0]
    victims = [s for s in sessions if before[s] == gone.id]
    assert victims
    seconds = {s: affinity.second_candidate(s) for s in victims}
    assert all(second not in (None, gone.id) for second in seconds.values())
    # The proxy's candidates reflect eligibility: a fenced worker is left out like a removed one.
    remaining = [w for w in workers if w is not gone]
    during = {s: affinity.choose(s, remaining).id for s in sessions}
    assert all(during[s] == seconds[s] for s in victims)
    assert all(during[s] == before[s] for s in sessions if s not in victims)
    assert stats.reassignments == {"not_eligible": len(victims)}
    # The worker comes back: the moved sessions stay where they went, the others never moved.
    after = {s: affinity.choose(s, workers).id for s in sessions}
    assert after == during
    assert affinity.pins_on(gone.id) == 0
    assert stats.reassignments == {"not_eligible": len(victims)}


def test_second_candidate_is_the_next_ranked_worker() -> None:
    workers = fleet(3)
    affinity, _ = table()
    key = "conversation"
    first = affinity.choose(key, workers)
    second = affinity.choose(key, [w for w in workers if w is not first])
    # With the first gone, a fresh table (no load yet) ranks the same: the second is its top choice.
    fresh, _ = table()
    assert fresh.choose(key, [w for w in workers if w is not first]).id == second.id


def test_a_retry_moves_the_pin_to_where_the_request_was_served() -> None:
    workers = fleet(3)
    affinity, stats = table()
    pinned = affinity.choose("s", workers)
    # The proxy leaves the failed worker out of a retry's candidates (its ``tried`` set).
    served = affinity.choose("s", [w for w in workers if w is not pinned], retry=True)
    assert served.id != pinned.id
    assert stats.reassignments == {"retry": 1}
    assert affinity.choose("s", workers).id == served.id
    assert affinity.pinned_worker("s") == served.id


def test_when_both_candidates_leave_the_session_is_placed_afresh() -> None:
    workers = fleet(4)
    affinity, stats = table()
    first = affinity.choose("s", workers)
    second = affinity.choose("s", [w for w in workers if w is not first])
    third = affinity.choose("s", [w for w in workers if w not in (first, second)])
    assert third.id not in {first.id, second.id}
    assert affinity.choose("s", workers).id == third.id
    assert stats.reassignments == {"not_eligible": 2} and stats.new_pins == 1


def test_a_pin_expires_after_its_ttl_and_each_hit_refreshes_it() -> None:
    clock = FakeClock()
    workers = fleet(4)
    affinity, stats = table(ttl_s=10.0, clock=clock)
    pinned = affinity.choose("s", workers)
    clock.now += 9.0
    assert affinity.choose("s", workers).id == pinned.id  # a hit: lives 10 s from now
    clock.now += 9.0
    assert affinity.pinned_worker("s") == pinned.id
    clock.now += 1.0
    assert affinity.pinned_worker("s") is None
    other = affinity.choose("other", workers)  # any call drops what has expired
    assert len(affinity) == 1
    assert sum(affinity.pins_on(w.id) for w in workers) == 1 and affinity.pins_on(other.id) == 1
    affinity.choose("s", workers)
    assert stats.new_pins == 3 and stats.hits == 1 and stats.pinned == 2


def test_expired_pins_are_dropped_and_the_session_does_not_return_to_its_old_second() -> None:
    clock = FakeClock()
    workers = fleet(3)
    affinity, stats = table(ttl_s=5.0, clock=clock)
    first = affinity.choose("s", workers)
    moved = affinity.choose("s", [w for w in workers if w is not first])
    clock.now += 6.0
    # Expired: placed afresh by the ranking, a new pin (not a reassignment).
    assert affinity.choose("s", workers).id == first.id
    assert moved.id != first.id
    assert stats.new_pins == 2 and stats.reassignments == {"not_eligible": 1}


def test_the_table_is_capped_and_forgets_the_least_recently_used() -> None:
    workers = fleet(4)
    affinity, stats = table(max_sessions=3)
    for key in ("a", "b", "c"):
        affinity.choose(key, workers)
    affinity.choose("a", workers)  # "a" is now the most recently used
    affinity.choose("d", workers)
    assert len(affinity) == 3 and stats.pinned == 3
    assert affinity.pinned_worker("b") is None
    assert all(affinity.pinned_worker(k) is not None for k in ("a", "c", "d"))
    assert sum(affinity.pins_on(w.id) for w in workers) == 3


def test_a_single_worker_takes_every_session() -> None:
    affinity, _ = table()
    (only,) = fleet(1)
    assert {affinity.choose(f"s{i}", [only]).id for i in range(10)} == {only.id}


@pytest.mark.parametrize(
    ("rid", "lineage"),
    [
        ("abc_t3_r1", "abc"),
        ("abc_r2", "abc"),
        ("abc_r2_t3", "abc"),
        ("abc_t1_r1_t2", "abc"),
        ("abc", "abc"),
        ("x_t", "x_t"),
        ("x_r", "x_r"),
        ("x_t3x", "x_t3x"),
        ("run_7_t2", "run_7"),
        ("a_t1b_t2", "a_t1b"),
        ("_t1", "_t1"),
        ("", None),
        (None, None),
        (17, None),
        (["a_t1", "b_t1"], None),
        ({"rid": "a"}, None),
    ],
)
def test_rid_lineage(rid: object, lineage: str | None) -> None:
    assert rid_lineage(rid) == lineage


def test_session_key_order() -> None:
    body = {"rid": "conv_t4", "user": "trainer"}
    assert session_key({SESSION_ID_HEADER: "sid", ROUTING_KEY_HEADER: "rk"}.get, body) == "sid"
    assert session_key({ROUTING_KEY_HEADER: "rk"}.get, body) == "rk"
    assert session_key({SESSION_ID_HEADER: ""}.get, body) == "conv"
    assert session_key({}.get, body) == "conv"
    assert session_key({}.get, {"user": "trainer"}) is None  # ``user`` names an end user, not a session
    assert session_key({}.get, {"rid": ["a_t1", "b_t1"]}) is None
    assert session_key({}.get, None) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("session_affinity_ttl_s", 0.0), ("session_affinity_load_factor", -0.1), ("session_affinity_max_sessions", 0)],
)
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    config = RouterConfig(session_affinity=True, **{field: value})
    with pytest.raises(ValueError, match=field):
        config.validate()


# -- a data plane's copies of the one table's pins (router/gateway/data_planes/session_pins.py) ------------------


class ControlTable:
    """The control process's side, in-process: a real table answering every Place a data plane posts."""

    def __init__(self, clock: FakeClock) -> None:
        self.table, _ = table(clock=clock)
        self.asked: list[str] = []
        self.copies: list[SessionPins] = []
        self.table.on_forget = lambda row: [c.forget([row]) for c in self.copies]

    def copy(self, clock: FakeClock, workers: list[Worker]) -> SessionPins:
        pins: SessionPins

        def post(text: str) -> None:
            ask = TO_CONTROL.validate_json(text)
            assert isinstance(ask, Place)
            self.asked.append(ask.session)
            chosen = self.table.choose(ask.session, [w for w in workers if w.id in ask.candidates], retry=ask.retry)
            asyncio.get_running_loop().call_soon(pins.answered, ask.id, chosen.id)

        pins = SessionPins(ttl_s=60.0, max_sessions=100, post=post, stats=AffinityStats(), clock=clock)
        self.copies.append(pins)
        return pins


async def test_data_planes_place_through_the_one_table_and_serve_turns_from_their_copies() -> None:
    clock, workers = FakeClock(), fleet(4)
    control = ControlTable(clock)
    one, other = control.copy(clock, workers), control.copy(clock, workers)
    first = await one.choose("s1", workers, retry=False)
    assert first is not None and control.asked == ["s1"]
    assert await one.choose("s1", workers, retry=False) is first  # a copy: nothing asked
    assert control.asked == ["s1"] and one.take_used() == [session_row("s1")]
    assert await other.choose("s1", workers, retry=False) is first  # the other process asks and agrees
    assert control.asked == ["s1", "s1"]

    # Its worker out of one process's candidates: the table moves the pin and every copy is dropped.
    rest = [w for w in workers if w is not first]
    moved = await one.choose("s1", rest, retry=False)
    assert moved is not None and moved is not first and len(other) == 0
    assert await other.choose("s1", workers, retry=False) is moved  # not back to the old worker
    # A copy lives the table's TTL less the answer's bound, from its last use.
    asked = len(control.asked)
    clock.now += 60.0 - PLACE_TIMEOUT_S - 1
    assert await one.choose("s1", workers, retry=False) is moved and len(control.asked) == asked
    clock.now += 60.0 - PLACE_TIMEOUT_S
    assert await one.choose("s1", workers, retry=False) is moved and len(control.asked) == asked + 1


async def test_a_data_plane_places_on_its_own_when_the_control_process_does_not_answer() -> None:
    pins = SessionPins(ttl_s=60.0, max_sessions=100, post=lambda _text: None, stats=AffinityStats())
    assert await pins.choose("s1", fleet(2), retry=False) is None and len(pins) == 0
