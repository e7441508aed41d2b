"""Fencing: an update's targets leave request routing until its outcome is known.

Before a fenced operation contacts anyone, its targets are written to the
journal (durably) and disabled. The fence settles exactly once: :meth:`Fence.succeed`
restores each target's previous ``disabled`` flag and clears the journal;
:meth:`Fence.fail` keeps every target disabled and the journal entry pending until
an operator resolves it, because any target's weights may differ from the others'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
    def raise_around(cls, targets: Sequence[Worker], path: str, journal: UpdateJournal) -> Fence:
        """Journal the targets durably, then disable them. Raises (changing nothing) if either step cannot start."""
        require_no_pending_failure(journal)
        journal.begin(path, [(w.id, w.url, w.disabled) for w in targets])
        previous = {w.id: w.disabled for w in targets}
        for w in targets:
            w.disabled = True
            w.update_holds += 1
        return cls(path=path, targets=list(targets), previous=previous, journal=journal)

    def succeed(self) -> None:
        """Known-good outcome: restore every target's previous flag and drop the journal entry."""
        if self._settle():
            for w in self.targets:
                w.disabled = self.previous[w.id]
            self.journal.clear()

    def fail(self, failed_ids: Sequence[str], reason: str) -> None:
        """Uncertain outcome: every target stays disabled until an operator resolves it."""
        if self._settle():
            for w in self.targets:
                w.disabled = True
            self.journal.fail(failed_ids, reason)
            log.error("%s failed (%s); %d target(s) kept disabled", self.path, reason, len(self.targets))

    def _settle(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        for w in self.targets:
            w.update_holds = max(0, w.update_holds - 1)
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
