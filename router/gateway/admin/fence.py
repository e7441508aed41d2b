"""Fencing: an update's targets leave request routing until its outcome is known.

Before a fenced operation contacts anyone, its targets are disabled, written to the
journal (durably) and every routing process has applied the fence (the journal write and
that acknowledgement run at once: neither needs the other). The fence settles exactly once, worker by worker
(:meth:`Fence.settle`): the targets the caller names as kept stay disabled, with the
journal entry narrowed to them until an operator resolves it, because their weights may
differ from the fleet's; every other target gets its previous ``disabled`` flag back.
Which targets are kept is decided from each worker's own answer (``verdicts``; the rule
is written once, in docs/weight-sync.md). :meth:`Fence.succeed` keeps none;
:meth:`Fence.fail` keeps all, for an outcome that cannot be known per worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.contract.errors import Conflict
from router.gateway.admin.journal import UpdateJournal
from router.gateway.fleet.registry import Worker

log = logging.getLogger(__name__)

RESOLVE_HINT = (
    're-enable each worker with PUT /workers/{id} {"disabled": false} once it is repaired, '
    'or POST /weight_update_journal/resolve {"acknowledge": true}'
)


@dataclass
class Fence:
    """Targets taken out of routing for one update; settles exactly once."""

    path: str
    targets: list[Worker]
    previous: dict[str, bool]
    journal: UpdateJournal
    settled: bool = field(default=False)

    @classmethod
    def take_out(cls, targets: Sequence[Worker], path: str, journal: UpdateJournal) -> Fence:
        """Disable the targets (409, changing nothing, while an earlier failure is unresolved). The fence holds
        once :meth:`write_journal` has made it durable and every routing process has applied it; until then
        nothing may be sent to a target."""
        require_no_pending_failure(journal)
        previous = {w.id: w.disabled for w in targets}
        for w in targets:
            w.disabled = True
            w.update_holds += 1
        return cls(path=path, targets=list(targets), previous=previous, journal=journal)

    async def write_journal(self) -> None:
        """Journal the targets durably (503 when it cannot be written: then nothing was written)."""
        await self.journal.begin(self.path, [(w.id, w.url, self.previous[w.id]) for w in self.targets])

    def put_back(self) -> None:
        """Nothing was journaled or sent: every target gets its previous flag back."""
        self._settle(())

    async def settle(self, kept_ids: Sequence[str], reason: str, *, announce: Callable[[], None] | None = None) -> None:
        """Restore every target's previous flag except ``kept_ids``, which stay disabled; the journal
        entry is dropped when none is kept, else narrowed to them until an operator resolves it.
        ``announce`` is told once the flags are restored, before the journal is written (the data planes
        learn the change while the write runs)."""
        if not self._settle(kept_ids):
            return
        if announce is not None:
            announce()
        if kept_ids:
            await self.journal.fail(kept_ids, reason)
            log.warning("%s failed (%s); %d target(s) kept disabled", self.path, reason, len(kept_ids))
        else:
            self.journal.clear_soon()

    async def succeed(self) -> None:
        await self.settle((), "")

    async def fail(self, reason: str) -> None:
        """Every target's outcome is uncertain: all stay disabled."""
        await self.settle([w.id for w in self.targets], reason)

    def fail_now(self, reason: str) -> None:
        """:meth:`fail` without awaiting (an interrupted operation, perhaps at shutdown)."""
        kept = [w.id for w in self.targets]
        if self._settle(kept):
            self.journal.fail_now(kept, reason)
            log.warning("%s interrupted (%s); %d target(s) kept disabled", self.path, reason, len(kept))

    def _settle(self, kept_ids: Sequence[str]) -> bool:
        if self.settled:
            return False
        self.settled = True
        kept = set(kept_ids)
        for w in self.targets:
            w.update_holds = max(0, w.update_holds - 1)
            w.disabled = True if w.id in kept else self.previous[w.id]
        return True


def require_no_pending_failure(journal: UpdateJournal) -> None:
    """Refuse (409) while an earlier update's failure is unresolved."""
    pending = journal.pending
    if pending is not None:
        ids = ", ".join(t.id for t in pending.targets)
        raise Conflict(
            f"an earlier update ({pending.path}) did not finish cleanly: {pending.reason or pending.state}; "
            f"workers {ids} are kept disabled. {RESOLVE_HINT}",
            journal=pending.model_dump(),
        )
