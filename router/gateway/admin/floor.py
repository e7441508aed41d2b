"""The healthy floor (``--min-routable-workers``): a weight sync that would leave fewer workers able to serve
the new weights than the floor is refused (409) before it starts, and changes nothing.

NeMo-RL asked for it (``min_healthy_shards``): a trainer that syncs into a fleet that has mostly failed keeps
training against a handful of engines, and every rollout then queues on them. Refusing the sync tells the
trainer at the moment it can still decide (wait, repair, stop) instead of after the fleet moved on.

Which calls are checked: the ones that *start* a weight sync (:func:`starts_sync`), so that a refusal lands
before any worker received anything:

- ``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/update_weights_from_distributed`` and a
  ``/collective_rpc`` of a method that may change the weights: each is a whole sync in one call;
- ``/prepare_weights_update`` (SGLang's two-phase sync) and vLLM's ``/start_weight_update``: they open an
  update the router holds until its ``/complete_weights_update`` or ``/finish_weight_update``.

Not checked, on purpose: the steps inside an update already admitted (``/complete_weights_update``,
``/finish_weight_update``, vLLM's ``/update_weights``): refusing them would strand the held update, whose
targets the start already counted; ``/update_weight_version``, which names weights already loaded (often the
tail of a sync that passed the floor: refusing it would leave them loaded and unnamed); and
``/resume_memory_occupation`` and ``/wake_up``, which bring back weights the workers held: refusing them could
only leave fewer workers serving.

Who counts (:func:`why_left_out`): a target of the call that is healthy, enabled (not disabled by an operator
or kept fenced by an earlier failure), still listed by discovery, and that no catch-up is repairing (its
``catch_up`` is unset: not copying, failed or retired). A worker that an update in flight holds is judged by
the flag it had before that update fenced it.

A targeted call (``?workers=``, ``?selector=``, the RL API's selection) moves the fleet's current version to
its targets only: the workers it leaves out keep the version they held and are one version behind afterwards
(:meth:`~router.gateway.fleet.weights.FleetWeights.changed`), so under ``latest-only`` only the targets serve.
Its count is therefore that of the targets able to take it, against the same floor as a fleet-wide call. A
share (``0.75``) is always of the registered workers that discovery still lists, dead ones included: the
floor is what the fleet should have, and a dead worker lowers the count, never the floor.

Why before the lock: a refusal must change nothing, and the lock is the first thing an update changes (every
other admin call and catch-up waits behind it; a held update keeps it between calls), so a call the fleet is
too thin for does not queue behind another update. It is read once more when the lock is taken
(:meth:`~router.gateway.admin.locked.AdminRun.open`), before the fence: a worker that died or was disabled
while the call waited makes it a 409 there too, with nothing sent and the lock released at once. A failure of
an update ahead of it leaves a journal entry that refuses the next fenced update (409) until an operator
resolves it.

A retired worker is no target of a fleet-wide call at all (:meth:`~router.gateway.admin.locked.AdminContext.
live_targets`): it would fail the fleet's update, and it serves nothing until its process restarts.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from router.contract import endpoints as ep
from router.contract.base import WireRequest, WireResponse
from router.contract.errors import Conflict
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.operations import Operation
from router.gateway.fleet.registry import Worker, WorkerRegistry

#: Calls that load new weights and end in the same call.
_WHOLE_SYNCS = frozenset(
    e.path
    for e in (
        ep.UPDATE_WEIGHTS_FROM_DISK,
        ep.UPDATE_WEIGHTS_FROM_TENSOR,
        ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
        ep.COLLECTIVE_RPC,
    )
)
#: Calls that open an update the router holds until a later call ends it.
_HELD_SYNC_STARTS = frozenset(e.path for e in (ep.PREPARE_WEIGHTS_UPDATE, ep.START_WEIGHT_UPDATE))

#: Workers named in a refusal's message; the answer's ``min_routable_workers.out`` has all of them.
_NAMED = 5


def starts_sync(op: Operation[WireRequest, WireResponse]) -> bool:
    """Whether ``op`` starts a weight sync (the module docstring says which and why). ``/collective_rpc`` of a
    method known to read only is its own operation, which changes no weights: not a sync."""
    if op.path in _HELD_SYNC_STARTS:
        return True
    return op.path in _WHOLE_SYNCS and op.changes_weights


def needed(floor: float, registered: int) -> int:
    """How many workers must be able to take a sync: ``floor`` itself, or a share below 1 of ``registered``
    rounded up (0 when the floor is off)."""
    if floor <= 0:
        return 0
    if floor < 1:
        # 0.1 * 30 is 3.0000000000000004 in floating point: a share that lands on a whole number is that number.
        return math.ceil(floor * registered - 1e-9)
    return int(floor)


def why_left_out(worker: Worker, journal: UpdateJournal) -> str | None:
    """Why ``worker``, a target, would not serve the new weights after the sync; ``None`` when it would."""
    if worker.health != "healthy":
        return worker.health
    if worker.departed is not None:
        return "departed"
    if _disabled_before_updates(worker, journal):
        entry = journal.pending
        kept = entry is not None and entry.state == "failed" and journal.names(worker.id)
        return "fenced by an earlier failed update" if kept else "disabled"
    if worker.catch_up is not None:
        return f"catch-up {worker.catch_up.state}"
    return None


def _disabled_before_updates(worker: Worker, journal: UpdateJournal) -> bool:
    """Its ``disabled`` flag as an update in flight found it: that update's fence is not a verdict on it (if it
    fails, its journal entry refuses the next fenced update anyway)."""
    if worker.update_holds == 0:
        return worker.disabled
    entry = journal.pending
    if entry is not None and entry.state == "in_flight":
        for target in entry.targets:
            if target.id == worker.id:
                return target.previous_disabled
    return False  # the update's entry is being written: that update decides


def refuse_below_floor(
    registry: WorkerRegistry,
    journal: UpdateJournal,
    floor: float,
    op: Operation[WireRequest, WireResponse],
    only: Collection[str] | None,
) -> None:
    """409 (:class:`Conflict`) when ``op`` starts a weight sync that fewer than the floor's workers could take;
    called before the update lock is requested, so a refusal changes nothing. ``only``: a targeted call's ids."""
    if floor <= 0 or not starts_sync(op):
        return
    listed = [w for w in registry if w.departed is None]
    need = needed(floor, len(listed))
    candidates = [w for w in registry if only is None or w.id in only]
    out = {w.id: why for w in candidates if (why := why_left_out(w, journal)) is not None}
    able = len(candidates) - len(out)
    if able >= need:
        return
    share = f" ({floor:g} of {len(listed)} registered, rounded up)" if floor < 1 else ""
    if only is None:
        head = f"{able} of {len(listed)} workers can take {op.path}"
    else:
        head = (
            f"{able} of the {len(candidates)} targeted workers can take {op.path} (only its targets will hold "
            "the new weights)"
        )
    named = [f"{wid} ({why})" for wid, why in list(out.items())[:_NAMED]]
    more = f" and {len(out) - _NAMED} more" if len(out) > _NAMED else ""
    left_out = f"; left out: {', '.join(named)}{more}" if out else ""
    raise Conflict(
        f"{head}; --min-routable-workers needs {need}{share}{left_out}. Nothing was changed",
        min_routable_workers={"needed": need, "able": able, "registered": len(listed), "out": out},
    )
