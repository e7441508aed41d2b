"""Admin operations, each a plain function run on a rank's scheduler thread.

Every function takes the rank's :class:`Scheduler` and a validated wire
message, and returns a typed :class:`~worker.engine.results.OpResult`. They run between forward steps, so
they see a consistent set of requests and never race a forward pass.
"""

from __future__ import annotations

from typing import Any

from router.contract.admin import (
    AbortRequest,
    ContinueRequest,
    MemoryOccupationRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)
from router.contract.vllm_dev import AbortRequestsRequest
from worker.engine.checker import CheckerError
from worker.engine.model_worker import MEMORY_TAGS, WeightUpdateError
from worker.engine.results import (
    Aborted,
    AbortedRequests,
    CheckerReport,
    Continued,
    OpResult,
    Paused,
    Released,
    Resumed,
    VersionSet,
)
from worker.engine.scheduler import Scheduler


def active_requests_message(count: int, what: str, *, can_abort_all: bool = True) -> str:
    """Why ``what`` is refused while requests hold KV; ``can_abort_all`` when the
    operation takes ``abort_all_requests``."""
    hint = " (or pass abort_all_requests=true)" if can_abort_all else ""
    return (
        f"cannot {what}: {count} active request(s) hold KV cache computed with the current weights; "
        f"pause with mode=retract or abort them first{hint}"
    )


def pause(s: Scheduler, *, mode: str) -> OpResult[Paused]:
    return OpResult(True, "Generation paused successfully.", s.pause(mode))


def continue_generation(s: Scheduler, req: ContinueRequest) -> OpResult[Continued]:
    was_paused = s.is_paused
    s.continue_generation(empty_cache=req.torch_empty_cache)
    return OpResult(True, "Generation continued successfully.", Continued(was_paused))


def abort_request(s: Scheduler, req: AbortRequest) -> OpResult[Aborted]:
    """Prefix-match abort. An empty ``rid`` without ``abort_all`` aborts nothing:
    SGLang's tokenizer also returns early for a rid it does not know, and a
    prefix of ``""`` would otherwise match every request."""
    message = req.abort_message or "Aborted by /abort_request"
    rids = req.rid if isinstance(req.rid, list) else [req.rid]
    aborted: list[str] = []
    if req.abort_all:
        aborted = s.abort_all(message)
    else:
        for rid in rids:
            aborted += s.abort_matching(rid, message=message)
    return OpResult(True, f"aborted {len(aborted)} request(s)", Aborted(len(aborted), aborted))


def abort_requests(s: Scheduler, req: AbortRequestsRequest) -> OpResult[AbortedRequests]:
    """vLLM's abort: the requests whose rid is one of ``req``'s ids, with their choices (a call's
    choice ``j`` runs as ``<id>-<j>``); every request when ``req`` names none."""
    message = "Aborted by /abort_requests"
    if req.abort_all:
        aborted = s.abort_all(message)
    else:
        wanted = set(req.ids())
        aborted = s.abort_where(lambda rid: rid in wanted or _parent_rid(rid) in wanted, message)
    return OpResult(True, f"aborted {len(aborted)} request(s)", AbortedRequests(len(aborted), aborted))


def _parent_rid(rid: str) -> str | None:
    """The call a choice's rid belongs to (``<id>-<j>`` → ``<id>``), or None."""
    parent, _, index = rid.rpartition("-")
    return parent if parent and index.isdigit() else None


def flush_cache(s: Scheduler, _req: Any = None) -> OpResult[None]:
    ok, message = s.flush_cache()
    return OpResult(ok, message)


def update_weight_version(s: Scheduler, req: UpdateWeightVersionRequest) -> OpResult[VersionSet]:
    """Set the label, then (by default, as SGLang) abort every request. The
    aborted responses are built after the change, so they carry the new label,
    which is what SGLang's asynchronous abort shows in practice."""
    s.worker.weight_version = req.new_version
    aborted = s.abort_all("Aborted: weight version updated") if req.abort_all_requests else []
    return OpResult(True, f"Weight version updated to {req.new_version}", VersionSet(req.new_version, len(aborted)))


def weights_checker(s: Scheduler, req: WeightsCheckerRequest) -> OpResult[CheckerReport]:
    try:
        report = s.worker.run_checker(req.action, req.skip_tensor_list or ())
    except (CheckerError, WeightUpdateError) as exc:
        return OpResult(False, str(exc), CheckerReport(req.action))
    if report.diff is not None and report.diff.differing:
        message = f"check tensor equality failed: {report.diff.differing} tensor(s) differ from the snapshot"
        return OpResult(False, message, report)
    return OpResult(True, f"{req.action} done over {report.tensor_count} tensors", report)


def _tags(req: MemoryOccupationRequest) -> list[str]:
    return list(req.tags) if req.tags else list(MEMORY_TAGS)


def release_memory(s: Scheduler, req: MemoryOccupationRequest) -> OpResult[Released]:
    """Refused while requests are active. Queued requests stay queued: generation
    does not step while any memory is released (they run after resume)."""
    if s.active_request_count:
        return OpResult(False, active_requests_message(s.active_request_count, "release memory", can_abort_all=False))
    released = s.worker.release_memory(_tags(req), keep_weights=req.keep_weights)
    return OpResult(True, f"released {', '.join(released) or 'nothing (already released)'}", Released(released))


def resume_memory(s: Scheduler, req: MemoryOccupationRequest) -> OpResult[Resumed]:
    resumed = s.worker.resume_memory(_tags(req))
    return OpResult(True, f"resumed {', '.join(resumed) or 'nothing (not released)'}", Resumed(resumed))
