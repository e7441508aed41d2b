"""Whether each target of a weight change holds the weights it should, before the change is published.

An engine's 200 to an update says the call ran, not which weights the engine now serves: a transfer
that moved nothing (vLLM's NCCL engine off CUDA, vllm-project/vllm #57022), a reload from a stale
path or a name mapping that skipped tensors all answer 200, and every worker then agrees with the
others on the old weights. So after the engines answered, and before the fence is settled, the router
reads each target's digest through its engine (:attr:`~router.gateway.engines.base.Engine.digest_request`,
:func:`~router.contract.weight_digest.of_checker_answer`), all at once and bounded by the checker
route's budget, and a target fails the update when:

- the caller named the weights (:data:`~router.contract.weight_digest.EXPECTED_CHECKSUM_HEADER`) and
  the target holds others;
- ``--verify-updates changed`` is on, the operation brings new tensors, the caller did not say the
  weights stay as they are, and the target's digest is the one it had before the call;
- its digest cannot be read (no checker, no answer): what it holds is then not known.

A failed target is a failure of the update like any other: the fence stays on it, the journal keeps
the entry, its version is not recorded, and the answer says each target's digest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.contract.base import WireResponse
from router.contract.fleet_answers import WorkerResult
from router.contract.weight_digest import of_checker_answer
from router.gateway.admin.expectation import Expectation
from router.gateway.admin.fanout import AdminCall, FanOut
from router.gateway.admin.operations import OPERATIONS
from router.gateway.engines import engine_of
from router.gateway.fleet.registry import Worker


@dataclass(frozen=True, slots=True)
class Digest:
    """One worker's digest as read, or why it could not be."""

    value: str | None
    error: str | None = None

    def describe(self) -> str:
        return self.value if self.value is not None else f"unknown ({self.error})"


async def read_digests(fanout: FanOut, workers: Sequence[Worker], headers: dict[str, str]) -> dict[str, Digest]:
    """Every worker's digest, read at once through its engine's checker (one fan-out per engine)."""
    by_call: dict[str, list[Worker]] = {}
    digests: dict[str, Digest] = {}
    for worker in workers:
        engine = engine_of(worker)
        if engine is None or engine.digest_request is None:
            digests[worker.id] = Digest(None, f"its engine ({worker.engine or 'unknown'}) reports no digest")
        else:
            by_call.setdefault(engine.name, []).append(worker)

    async def one_engine(group: list[Worker]) -> list[WorkerResult[WireResponse]]:
        engine = engine_of(group[0])
        assert engine is not None and engine.digest_request is not None
        endpoint, request = engine.digest_request
        op = OPERATIONS[endpoint.path]
        call = AdminCall(op, "POST", request, headers, op.router_wait(request))
        return await fanout.to_all(group, call)

    for results in await asyncio.gather(*(one_engine(g) for g in by_call.values())):
        for r in results:
            value = of_checker_answer(r.body) if r.success else None
            digests[r.worker] = Digest(value, None if value is not None else r.reason()[:200] or "no digest")
    return digests


def judge(
    results: Iterable[WorkerResult[WireResponse]],
    after: Mapping[str, Digest],
    expected: Expectation,
    before: Mapping[str, Digest] | None,
) -> None:
    """Fail every target that succeeded at the engine but does not hold what it should (module docstring).
    ``after`` is what each target holds in the scheme of ``expected``; ``before`` (to show a change) and the
    digest compared with it are both the engine's checker's (``after`` too, unless a digest was reported)."""
    for r in results:
        if not r.success:
            continue
        problem = _problem(after.get(r.worker, NOT_READ), expected)
        if problem is None and before is not None and expected.change == "changed":
            problem = _unchanged(before.get(r.worker, NOT_READ), after.get(r.worker, NOT_READ))
        if problem is not None:
            r.success = False
            r.error = f"the engine answered {r.status_code} but {problem}"


NOT_READ = Digest(None, "not read")


def _problem(digest: Digest, expected: Expectation) -> str | None:
    if expected.checksum is None:
        return None
    if digest.value is None:
        return f"its weights' digest could not be read: {digest.error}"
    if digest.value != expected.checksum:
        return f"it holds weights {digest.value}, not the expected {expected.checksum}"
    return None


def _unchanged(before: Digest, after: Digest) -> str | None:
    if after.value is None:
        return f"its weights' digest could not be read: {after.error}"
    if before.value is None:
        return f"its digest before the update could not be read ({before.error}), so a change cannot be shown"
    if before.value == after.value:
        return f"its weights did not change (digest {after.value} before and after)"
    return None


def digests_view(after: Mapping[str, Digest]) -> dict[str, str | None]:
    """Each target's digest for the caller's answer (``None``: not readable)."""
    return {worker: d.value for worker, d in after.items()}
