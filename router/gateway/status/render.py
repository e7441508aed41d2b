"""What ``omni-router status`` prints: the report as one JSON document, or as plain-text tables.

Only what the router reported is shown, its verdicts included; a field it did not report is a dash,
never a guess.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import BaseModel

from router.contract.fleet import CatchUpStatus, FleetVersionEntry, FleetVersions, JournalView, LeaderView
from router.contract.fleet_status import ExitCode, FleetStatus, LastUpdate, WorkerStatus

#: Recorded fleet versions listed in the text (the router keeps a bounded history; ``--json`` has all of it).
SHOWN_VERSIONS = 5
#: Characters of a weights checksum shown in the text: enough to tell two apart at a glance.
CHECKSUM_CHARS = 16
NONE = "-"


class StatusReport(BaseModel):
    """``omni-router status --json``: the router's ``GET /fleet/status``, with the router it came from."""

    router: str
    taken_at: float
    """When the router read its state (``read_at``, the router's clock): ages are shown against it."""
    exit_code: ExitCode
    leader: LeaderView
    workers: list[WorkerStatus]
    journal: JournalView
    resolve_hint: str | None = None
    """How an operator clears the journal's entry, while there is one."""
    fleet_versions: FleetVersions
    last_update: LastUpdate | None = None


def build_report(router: str, status: FleetStatus) -> StatusReport:
    """The router's answer under the names ``--json`` has always printed."""
    return StatusReport(
        router=router,
        taken_at=status.read_at,
        exit_code=status.exit_code,
        leader=status.leader,
        workers=status.workers,
        journal=status.journal,
        resolve_hint=status.resolve_hint,
        fleet_versions=status.versions,
        last_update=status.last_update,
    )


def render_text(report: StatusReport) -> str:
    lines = [_headline(report), ""]
    lines += _workers(report.workers)
    lines += ["", *_journal(report)]
    lines += ["", *_versions(report.fleet_versions, report.taken_at)]
    lines += ["", *_last_update(report.last_update, report.taken_at)]
    return "\n".join(lines) + "\n"


def _last_update(update: LastUpdate | None, now: float) -> list[str]:
    """The last weight change's phases (milliseconds; total last)."""
    if update is None:
        return ["Last update: none since the router started"]
    phases = ", ".join(f"{name} {ms:.1f}" for name, ms in update.timings.items())
    head = f"Last update: {update.operation} {update.outcome}, {_when(update.ended_at, now)} (id {update.operation_id})"
    return [head, f"  phases (ms): {phases}"]


def _headline(report: StatusReport) -> str:
    role = f" ({report.leader.role})"
    routable = sum(w.routable for w in report.workers)
    return (
        f"omni-router {report.router}{role}: {len(report.workers)} worker(s), {routable} routable; "
        f"read at {_clock(report.taken_at)}"
    )


def _workers(statuses: Sequence[WorkerStatus]) -> list[str]:
    if not statuses:
        return ["Workers: none registered"]
    header = ["ID", "URL", "ENGINE", "HEALTH", "VERSION", "PAUSED", "DISABLED", "PENDING", "INFLIGHT", "CATCH-UP"]
    rows = [
        [
            s.id,
            s.url,
            s.engine or NONE,
            s.health,
            _version(s),
            "yes" if s.paused else "own" if s.reported_paused else "no",
            "fenced" if s.fenced else "yes" if s.disabled else "no",
            "yes" if s.pending is not None else "no",
            str(s.inflight),
            _catch_up(s.catch_up),
            "yes" if s.routable else f"no: {s.out_of_rotation}",
        ]
        for s in statuses
    ]
    return ["Workers:", *_table([*header, "ROUTABLE"], rows)]


def _version(s: WorkerStatus) -> str:
    label = s.weight_version or NONE
    return f"{label} ({s.staleness} behind)" if s.staleness else label


def _catch_up(catch_up: CatchUpStatus | None) -> str:
    if catch_up is None:
        return NONE
    source = f" from {catch_up.source}" if catch_up.source else ""
    if catch_up.state == "copying":
        return f"copying{source}"
    return f"{catch_up.state}{source} ({catch_up.attempts} attempt(s))"  # failed, or retired: ROUTABLE says why


def _journal(report: StatusReport) -> list[str]:
    view = report.journal
    storage = view.storage
    if storage is None:
        kept = "memory only (no --state-dir)"
    elif storage.healthy:
        kept = f"stored in {storage.location}"
    else:
        unsaved = f"; unsaved: {', '.join(storage.unsaved)}" if storage.unsaved else ""
        kept = f"the store {storage.location} refuses writes ({storage.error}){unsaved}"
    entry = view.pending
    if entry is None:
        return [f"Journal: no unresolved update ({kept})"]
    targets = ", ".join(t.id for t in entry.targets) or NONE
    lines = [
        f"Journal: {entry.state} {entry.path}, started {_when(entry.started_at, report.taken_at)} ({kept})",
        f"  targets: {targets}",
    ]
    if entry.failed:
        lines.append(f"  failed:  {', '.join(entry.failed)}")
    if entry.reason:
        lines.append(f"  reason:  {entry.reason}")
    if report.resolve_hint:
        lines.append(f"  resolve: {report.resolve_hint}")
    return lines


def _versions(versions: FleetVersions, now: float) -> list[str]:
    head = (
        f"Fleet versions: sequence {versions.sequence}, weight_version {versions.weight_version or NONE}, "
        f"policy {versions.version_policy}"
    )
    history = versions.history
    if not history:
        return [head, "  none recorded yet: every worker's boot weights count as the fleet's"]
    shown = history[-SHOWN_VERSIONS:]
    if len(shown) < len(history):
        head += f" (the last {len(shown)} of {len(history)} recorded)"
    rows = [_version_row(e, now) for e in shown]
    return [head, *_table(["SEQ", "VERSION", "RECORDED", "CHECKSUM", "SOURCE"], rows, indent="  ")]


def _version_row(entry: FleetVersionEntry, now: float) -> list[str]:
    checksum = entry.checksum
    if checksum is not None and len(checksum) > CHECKSUM_CHARS:
        checksum = checksum[:CHECKSUM_CHARS] + "…"
    return [
        str(entry.sequence),
        entry.weight_version or NONE,
        _when(entry.changed_at, now) if entry.changed_at else NONE,
        checksum or NONE,
        entry.source_path or NONE,
    ]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded (it may be long)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    out = []
    for row in [header, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out.append(indent + "  ".join([*cells, row[-1]]).rstrip())
    return out


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _when(t: float, now: float) -> str:
    return f"{_clock(t)} ({_ago(now - t)})"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"
