"""Versioned LoRA adapters published without pausing the fleet: immutable versions, old ones dropped.

A load whose name is ``name@version`` (:func:`~router.contract.lora.split_version`) adds that version beside
the ones the workers hold, all or nothing, as any load (:mod:`router.gateway.sync.adapters`); requests naming
``name`` switch to it in one step once it is recorded (:mod:`router.gateway.fleet.adapter_versions`).

- **A version is immutable.** Loading a version the fleet holds again is refused (409, nothing sent), as is a
  version of a name the fleet holds unversioned, or a plain name the fleet holds as versions: a request for
  ``name`` must mean one thing.
- **Old versions are dropped.** Once a version is published, the versions older than the newest
  ``--lora-keep-versions`` (N) are unloaded from every holder by :func:`retire_later`, in the background: it
  takes the update lock, stops routing them (every data plane has applied that before anything is sent),
  waits for the requests naming them to end (bounded, as an unload does), then unloads them. A request in
  flight is never failed by it: new requests had stopped naming those versions, and an omni-worker finishes
  a request with the adapter it started with.
- **The bound.** The next load of a version first drops, under its own lock, whatever the background drop has
  not dropped yet, and is refused (503, nothing sent) when a holder could not unload one of them, so no more
  than N versions are loaded when a new one is sent, and at most N + 1 of one adapter are ever resident on a
  worker: the new one while the oldest drains.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from router.contract import lora
from router.contract.admin import OPERATION_HEADER
from router.contract.errors import Conflict, Unavailable
from router.contract.lora import split_version
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import LORA_UNLOAD, V1_LORA_LOAD, V1_LORA_UNLOAD, Operation
from router.gateway.fleet.adapters import FleetAdapters
from router.gateway.sync.adapter_drain import drain, stop_routing

log = logging.getLogger(__name__)


def refuse_taken(adapters: FleetAdapters, name: str) -> None:
    """409 when loading ``name`` would change a version, or make a request's name mean two adapters."""
    split = split_version(name)
    if split is None:
        if adapters.versions(name):
            held = ", ".join(adapters.versions(name))
            raise Conflict(
                f"LoRA adapter {name!r} is loaded as versions ({held}): load a new version as {name}@<version>. "
                "Nothing was sent"
            )
        return
    family, version = split
    if adapters.get(name) is not None:
        raise Conflict(
            f"version {version!r} of LoRA adapter {family!r} is loaded already, and a version never changes: "
            f"load the new weights as a new version ({family}@<version>). Nothing was sent"
        )
    if adapters.get(family) is not None:
        raise Conflict(
            f"LoRA adapter {family!r} is loaded without a version: unload it before loading versions of it "
            f"({name}). Nothing was sent"
        )


def refuse_over_bound(adapters: FleetAdapters, family: str, name: str) -> None:
    """503 when versions of ``family`` outside the newest N are still loaded (a holder failed to unload them):
    loading ``name`` too would leave more than N + 1 resident. Nothing of it was sent; the next try drops them
    again first."""
    left = outdated(adapters, family)
    if left:
        raise Unavailable(
            f"{name} was not loaded: versions {', '.join(left)} of LoRA adapter {family!r} are outside the newest "
            f"{adapters.keep_versions} (--lora-keep-versions) and could not be unloaded from every holder; loading "
            f"another would leave more than {adapters.keep_versions + 1} resident. Nothing was sent"
        )


def unload_of(load: Operation[Any, Any]) -> Operation[Any, Any]:
    """The unload route of the engines a load went through (vLLM's for vLLM's load, else SGLang's)."""
    return V1_LORA_UNLOAD if load is V1_LORA_LOAD else LORA_UNLOAD


def outdated(adapters: FleetAdapters, family: str) -> list[str]:
    """The versions of ``family`` older than the newest ``keep_versions``, oldest first."""
    versions = adapters.versions(family)
    return list(versions[: max(0, len(versions) - adapters.keep_versions)])


async def retire(
    run: AdminRun[Any, Any], op: Operation[Any, Any], family: str, headers: dict[str, str]
) -> Sequence[str]:
    """Drop the versions of ``family`` outside the newest N from every holder (the caller holds the update lock);
    the versions dropped. A version a holder failed to unload stays, routed again, for the next drop."""
    ctx = run.ctx
    adapters = ctx.registry.adapters
    old = outdated(adapters, family)
    if not old:
        return []
    holders = {name: [w for w in ctx.registry.live() if adapters.holding(w, name) is not None] for name in old}
    await stop_routing(ctx, old, f"dropping versions {', '.join(old)} refused")
    await drain(ctx, old)
    dropped: list[str] = []
    headers = {k: v for k, v in headers.items() if k != OPERATION_HEADER}
    for name in old:
        request = (lora.VllmUnloadLoraAdapterRequest if op is V1_LORA_UNLOAD else lora.UnloadLoraAdapterRequest)(
            lora_name=name
        )
        call: AdminCall[Any, Any] = AdminCall(op, "POST", request, headers, timeout_s=op.router_wait(request))
        results = await run.fan_out(holders[name], call) if holders[name] else []
        failed = [r for r in results if not r.success]
        if not failed:
            adapters.remove(name)
            dropped.append(name)
            continue
        adapters.forget_holders(name, [r.worker for r in results if r.success])
        adapters.resume_serving(name)
        log.warning(
            "dropping LoRA adapter version %s failed on %s; it is retried before the next version is loaded",
            name,
            ", ".join(r.worker for r in failed),
        )
    ctx.barrier.announce()
    await adapters.save()
    if dropped:
        log.info("dropped LoRA adapter versions %s (keeping the newest %d)", ", ".join(dropped), adapters.keep_versions)
    return dropped


async def retire_later(ctx: AdminContext, load: Operation[Any, Any], family: str, headers: dict[str, str]) -> None:
    """:func:`retire` under the update lock, after a version was published (a background task). Whatever it did
    not drop, the next load of a version drops first."""
    op = unload_of(load)
    if not outdated(ctx.registry.adapters, family):
        return
    try:
        async with AdminRun.open(op, ctx) as run:
            await retire(run, op, family, headers)
            run.outcome = "success"
    except Exception as exc:  # the next load of a version retries it, under its own lock
        log.warning("dropping old versions of LoRA adapter %r failed: %s", family, exc)
