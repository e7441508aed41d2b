"""Which workers are in rotation, and the exit code that sums the fleet up: the rule, written once.

The router serves it as ``GET /fleet/status`` (:func:`fleet_status`); ``omni-router status`` and
the fleet page show that answer.

Decided from the registry's own fields, as the router decides routing (``latest-only``): a worker
takes generation traffic when it is healthy, enabled, still listed by discovery and not pending. A
worker the router paused counts as in rotation while the whole fleet is paused (a trainer's pause:
requests wait for the continue), and as out of it while the rest of the fleet runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.contract.fleet import FleetVersions, JournalState, JournalView, LeaderView, WorkerRecord
from router.contract.fleet_status import (
    ALL_ROUTABLE,
    NONE_ROUTABLE,
    SOME_OUT,
    ExitCode,
    FleetStatus,
    WorkerStatus,
)
from router.gateway.admin.fence import RESOLVE_HINT

__all__ = ["ALL_ROUTABLE", "NONE_ROUTABLE", "SOME_OUT", "WorkerStatus", "exit_code", "fleet_status", "judge", "summary"]

#: Workers named in the summary of a fleet with some out of rotation; the rest are counted.
NAMED_OUT = 5


def _fenced_ids(journal: JournalState | None) -> frozenset[str]:
    return frozenset() if journal is None else frozenset(t.id for t in journal.targets)


def _why_out(worker: WorkerRecord, fenced: bool, journal: JournalState | None) -> str | None:
    """Why ``worker`` is out of rotation, paused aside (that needs the rest of the fleet), or ``None``."""
    reasons: list[str] = []
    if worker.health != "healthy":
        detail = f" ({worker.engine_detail})" if worker.engine is None and worker.engine_detail else ""
        reasons.append(f"{worker.health}{detail}")
    if worker.departed is not None:
        reasons.append(f"departed: {worker.departed}")
    if worker.disabled:
        if fenced and journal is not None:
            what = "running" if journal.state == "in_flight" else "failed"
            reasons.append(f"fenced by the {what} update {journal.path}")
        else:
            reasons.append("disabled by the operator's flag")
    if worker.pending is not None:
        reasons.append(f"pending: {worker.pending}")
        catch_up = worker.catch_up
        if catch_up is not None and catch_up.state == "failed" and catch_up.last_error:
            reasons.append(f"catch-up failed: {catch_up.last_error}")
        elif catch_up is not None and catch_up.state == "retired":
            reasons.append(catch_up.detail or f"retired after {catch_up.attempts} failed catch-up attempts")
    return "; ".join(reasons) or None


def judge(workers: Sequence[WorkerRecord], journal: JournalState | None) -> list[WorkerStatus]:
    """Each worker with its verdict, in the registry's order."""
    fenced_ids = _fenced_ids(journal)
    reasons = {w.id: _why_out(w, w.disabled and w.id in fenced_ids, journal) for w in workers}
    fleet_runs = any(reasons[w.id] is None and not w.paused for w in workers)
    out = []
    for w in workers:
        why = reasons[w.id]
        if why is None and w.paused and fleet_runs:
            why = "paused by the router while the rest of the fleet runs"
        out.append(
            WorkerStatus.model_validate(
                {
                    **w.model_dump(),
                    "routable": why is None,
                    "fenced": w.disabled and w.id in fenced_ids,
                    "out_of_rotation": why,
                }
            )
        )
    return out


def exit_code(statuses: Sequence[WorkerStatus]) -> ExitCode:
    routable = sum(s.routable for s in statuses)
    if routable == 0:
        return NONE_ROUTABLE
    return ALL_ROUTABLE if routable == len(statuses) else SOME_OUT


def summary(statuses: Sequence[WorkerStatus]) -> str:
    """The verdict on the whole fleet in words: the counts, then what the exit code means."""
    routable = sum(s.routable for s in statuses)
    counts = f"{len(statuses)} worker(s), {routable} routable"
    if not statuses:
        return f"{counts}: none is registered"
    if routable == len(statuses):
        return f"{counts}: every worker takes generation traffic"
    if routable == 0:
        return f"{counts}: no worker takes generation traffic"
    out = [s.id for s in statuses if not s.routable]
    more = f" and {len(out) - NAMED_OUT} more" if len(out) > NAMED_OUT else ""
    return f"{counts}; out of rotation: {', '.join(out[:NAMED_OUT])}{more}"


def fleet_status(
    workers: Sequence[WorkerRecord],
    journal: JournalView,
    versions: FleetVersions,
    leader: LeaderView,
    read_at: float,
) -> FleetStatus:
    """``GET /fleet/status`` from the registry's records, the journal and the fleet's versions of one moment."""
    statuses = judge(workers, journal.pending)
    return FleetStatus(
        workers=statuses,
        journal=journal,
        resolve_hint=None if journal.pending is None else RESOLVE_HINT,
        versions=versions,
        leader=leader,
        exit_code=exit_code(statuses),
        summary=summary(statuses),
        read_at=read_at,
    )
