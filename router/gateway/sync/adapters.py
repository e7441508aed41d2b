"""LoRA adapters across the fleet: loaded on every live worker or on none, unloaded once unused.

- **A load or an update** (SGLang's ``/load_lora_adapter`` and ``/load_lora_adapter_from_tensors``, vLLM's
  ``/v1/load_lora_adapter``) goes to every live worker under the update lock. When every one succeeds, the
  name's next *fleet version* is recorded, held by exactly those workers (from the process each was
  loaded into), and requests naming it go to them only (:mod:`router.gateway.fleet.adapters`). When one
  fails, the workers that took it are rolled back to what they held: the previous version loaded again
  from its path, or the adapter unloaded when it is new. A worker that cannot be rolled back (no answer,
  or a previous version sent as tensors, which the router does not keep) and one whose own failure may
  have changed it (no answer) hold no version of the adapter from then on: no request naming it goes
  there until a later load succeeds. That is the fence rule, kept to the one adapter: the worker still
  serves the base model and every other adapter.
- **A load with the trainer's digest** (``X-Expected-Weights-Checksum``): a worker whose answer reports
  another checksum of the tensors it loaded (``lora_checksum``), or none, failed the load, and is rolled
  back with the others that took it: the adapter's version is recorded only when every worker holds the
  tensors the trainer named. A target whose engine never reports one (an SGLang server: its
  ``LoRAUpdateOutput`` has no digest) could only fail it, so such a load is refused (400) before anything is
  sent, naming those targets.
- **An unload** first stops routing the adapter (every data plane has applied it before anything is
  sent), then waits, within :data:`UNLOAD_DRAIN_S`, for the requests naming it to end, then unloads it
  from the workers that hold it. Past the bound it unloads anyway: an omni-worker finishes a request with
  the adapter it started with.
- **A version** (``name@version``) is immutable, and its publication drops the versions older than the newest
  ``--lora-keep-versions`` (:mod:`router.gateway.sync.adapter_versions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.contract import lora
from router.contract.errors import BadRequest, Conflict, NotFound
from router.contract.fleet_adapters import FleetAdapter
from router.contract.fleet_answers import FleetAnswer, WorkerResult
from router.contract.lora import TENSOR_SOURCE, split_version
from router.contract.weight_digest import EXPECTED_CHECKSUM_HEADER
from router.gateway.admin.answers import Outcome, fleet_answer, summarize
from router.gateway.admin.expectation import Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import LORA_LOAD, LORA_UNLOAD, V1_LORA_LOAD, V1_LORA_UNLOAD, Operation
from router.gateway.admin.verify import Digest, judge
from router.gateway.engines import engine_of
from router.gateway.fleet.adapter_versions import family_of
from router.gateway.fleet.registry import Worker
from router.gateway.sync.adapter_drain import REPORTS_CATCH_UP_S, UNLOAD_DRAIN_S, drain, stop_routing
from router.gateway.sync.adapter_versions import refuse_over_bound, refuse_taken, retire, retire_later, unload_of
from router.gateway.tasks import TaskSet

__all__ = ["REPORTS_CATCH_UP_S", "UNLOAD_DRAIN_S", "load_adapter", "unload_adapter"]

LoadRequest = lora.LoadLoraAdapterRequest | lora.LoadLoraAdapterFromTensorsRequest | lora.VllmLoadLoraAdapterRequest
UnloadRequest = lora.UnloadLoraAdapterRequest | lora.VllmUnloadLoraAdapterRequest
LoraAnswer = lora.LoraUpdateResult | lora.VllmLoraResult


def _source(req: LoadRequest) -> str:
    return TENSOR_SOURCE if isinstance(req, lora.LoadLoraAdapterFromTensorsRequest) else req.lora_path


def _untouched(result: WorkerResult[LoraAnswer]) -> bool:
    """A failed load that changed nothing: the worker answered a refusal (a load is atomic on the worker)."""
    return result.status_code is not None and 400 <= result.status_code < 500


def _rollback(
    call: AdminCall[LoadRequest, LoraAnswer], previous: FleetAdapter | None
) -> AdminCall[Any, LoraAnswer] | None:
    """The call that puts a worker back to ``previous`` (``None``: the adapter was new), or ``None`` when that
    cannot be done (the previous version came as tensors, which the router does not keep)."""
    name = call.request.lora_name
    vllm = isinstance(call.request, lora.VllmLoadLoraAdapterRequest)
    op: Operation[Any, LoraAnswer]
    req: Any
    if previous is None:
        op, req = (
            (V1_LORA_UNLOAD, lora.VllmUnloadLoraAdapterRequest)
            if vllm
            else (LORA_UNLOAD, lora.UnloadLoraAdapterRequest)
        )
        req = req(lora_name=name)
    elif previous.source == TENSOR_SOURCE:
        return None
    elif vllm:
        op, req = (
            V1_LORA_LOAD,
            lora.VllmLoadLoraAdapterRequest(lora_name=name, lora_path=previous.source, load_inplace=True),
        )
    else:
        op, req = LORA_LOAD, lora.LoadLoraAdapterRequest(lora_name=name, lora_path=previous.source)
    return AdminCall(op, "POST", req, call.headers, timeout_s=op.router_wait(req))


async def load_adapter(
    ctx: AdminContext,
    op: Operation[LoadRequest, LoraAnswer],
    call: AdminCall[LoadRequest, LoraAnswer],
    tasks: TaskSet | None = None,
) -> Outcome[LoraAnswer]:
    """Load (or update) one adapter on every live worker, or on none (see the module docstring). A version
    published drops the outdated ones afterwards, in ``tasks`` (without: when the next version is loaded)."""
    name = call.request.lora_name
    adapters = ctx.registry.adapters
    family = family_of(name) if split_version(name) is not None else None
    async with AdminRun.open(op, ctx) as run:
        try:
            refuse_taken(adapters, name)
        except Conflict:
            run.outcome = "refused"  # nothing was sent
            raise
        targets = ctx.live_targets(serving=op.path)
        if call.expect.checksum is not None:
            _refuse_undigested(targets, op)
        if family is not None:  # at most N versions loaded when one more is sent: see the bound
            await retire(run, unload_of(op), family, call.headers)
            refuse_over_bound(adapters, family, name)
        previous = adapters.get(name)
        results = await run.fan_out(targets, call)
        loaded = {r.worker for r in results if r.success}
        if call.expect.checksum is not None:
            _judge(results, call.expect)
        failed = [r for r in results if not r.success]
        if not failed:
            adapters.record_load(name, _source(call.request), targets)
            ctx.barrier.announce()
            await adapters.save()
            run.outcome = "success"
            if family is not None and tasks is not None:
                tasks.spawn(retire_later(ctx, op, family, call.headers), name=f"drop old versions of {family}")
            return Outcome(200, fleet_answer(op, results, "ok"))
        by_id = {w.id: w for w in targets}
        took = [by_id[r.worker] for r in results if r.worker in loaded]
        unknown = [r.worker for r in failed if r.worker not in loaded and not _untouched(r)]
        stuck = await _roll_back(run, call, previous, took)
        adapters.forget_holders(name, [*unknown, *stuck])
        ctx.barrier.announce()
        await adapters.save()
        message = f"{len(failed)} of {len(results)} worker(s) failed {op.path}: {summarize(failed)}"
        if took:
            message += f"; rolled back on {len(took) - len(stuck)} of {len(took)} worker(s) that had loaded it"
        if unknown or stuck:
            message += (
                f"; {', '.join([*unknown, *stuck])} hold no known version of {name!r} and get no request naming it "
                "until a load of it succeeds"
            )
        refused = not took and not unknown
        run.outcome = "refused" if refused else "failure"
        error = {"message": message}
        return Outcome(400 if refused else 502, fleet_answer(op, results, message, success=False, error=error))


def _refuse_undigested(targets: Sequence[Worker], op: Operation[LoadRequest, LoraAnswer]) -> None:
    """400 naming the targets whose engine reports no digest of the adapters it loads (nothing sent yet). A worker
    whose engine is not known yet is not judged here: it gets the load, and fails it if its answer shows none."""
    blind = [w for w in targets if (engine := engine_of(w)) is not None and not engine.reports_adapter_digest]
    if blind:
        names = ", ".join(f"{w.id} ({w.engine})" for w in blind)
        raise BadRequest(
            f"{EXPECTED_CHECKSUM_HEADER} cannot be checked on {op.path} to {len(blind)} worker(s) whose engine reports "
            f"no digest of the adapters it loads: {names}. Send the load without it. Nothing was sent",
            unserved=[w.id for w in blind],
        )


def _judge(results: Sequence[WorkerResult[LoraAnswer]], expect: Expectation) -> None:
    """Fail each worker that loaded the adapter but reports other tensors than the caller's digest names
    (or none): it answered 2xx, so it is rolled back like any worker that took a failed load."""
    after = {
        r.worker: Digest(r.body.lora_checksum, None)
        if isinstance(r.body, lora.LoraUpdateResult) and r.body.lora_checksum is not None
        else Digest(None, "its engine reports no digest of the adapters it loads")
        for r in results
    }
    judge(results, after, expect, None)


async def _roll_back(
    run: AdminRun[LoadRequest, LoraAnswer],
    call: AdminCall[LoadRequest, LoraAnswer],
    previous: FleetAdapter | None,
    took: Sequence[Worker],
) -> list[str]:
    """Put ``took`` back as they were; the ids of those it could not."""
    if not took:
        return []
    back = _rollback(call, previous)
    if back is None:
        return [w.id for w in took]
    results = await run.ctx.fanout.to_all(took, back)
    return [r.worker for r in results if not r.success]


async def unload_adapter(
    ctx: AdminContext, op: Operation[UnloadRequest, LoraAnswer], call: AdminCall[UnloadRequest, LoraAnswer]
) -> Outcome[LoraAnswer]:
    """Stop routing the adapter, let its requests end (bounded), unload it from its holders."""
    name = call.request.lora_name
    adapters = ctx.registry.adapters
    async with AdminRun.open(op, ctx) as run:
        entry = adapters.get(name)
        if entry is None:
            loaded = ", ".join(adapters.serving_names()) or "none"
            raise NotFound(f"LoRA adapter {name!r} is not loaded on the fleet (loaded: {loaded})")
        holders = [w for w in ctx.live_targets(serving=op.path) if adapters.holding(w, name) is not None]
        await stop_routing(ctx, [name], f"unload of {name!r} refused")
        await drain(ctx, [name])
        results = await run.fan_out(holders, call) if holders else []
        outcome = await run.settle(results) if results else Outcome(200, _nobody(op))
        if outcome.ok:
            adapters.remove(name)
        else:
            # Those that unloaded it hold it no more; the others still do and serve it again.
            adapters.forget_holders(name, [r.worker for r in results if r.success])
            adapters.resume_serving(name)
        ctx.barrier.announce()
        await adapters.save()
        return outcome


def _nobody(op: Operation[UnloadRequest, LoraAnswer]) -> FleetAnswer[LoraAnswer]:
    """The answer of an unload that no live worker had to take (no holder is live): it is simply forgotten."""
    return fleet_answer(op, [], "no live worker held it")
