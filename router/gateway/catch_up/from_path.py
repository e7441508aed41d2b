"""Catch-up from a checkpoint path: a joiner whose engine cannot load from a peer (vLLM, SGLang) loads the
fleet's weights from the checkpoint the fleet last loaded them from (``FleetVersionEntry.source_path``).

Neither vLLM 0.32 nor SGLang 0.5.23 streams its weights to a peer through a route this router can
drive (SGLang's remote-instance loading needs a group the two servers build between themselves), so
the only source they share with the fleet is the checkpoint itself. It exists when the fleet's current
weights came from one: an update from disk, vLLM's ``reload_weights``, or a relabel or memory resume of
such weights; weights that came over a group or in tensors have no file, and a joiner then waits,
pending, for the trainer's next sync.

The load, per engine (the fleet's label is set by the same call where the engine takes one):

- vLLM: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}``, then
  ``POST /update_weight_version {"new_version": label}``;
- SGLang and omni-worker: ``POST /update_weights_from_disk {"model_path": P, "weight_version": label,
  "abort_all_requests": false}`` (SGLang's relabel would abort every request by default).

The check before the joiner is recorded: its metadata read again shows the same process serving the
fleet's label, and, where a verified holder of the fleet's entry runs the same engine with the same
ranks, the two report the same weights (vLLM's per-tensor SHA-256 from ``/weight_checker``, SGLang's and
omni-worker's per-rank checksums from ``/weights_checker``). Without such a holder the label is all that
is checked, and the joiner's answer says so.
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from router.contract.admin import WeightsCheckerResult
from router.contract.fleet import FleetVersionEntry
from router.contract.vllm_rl import VllmWeightCheckerResult
from router.gateway.engines import engine_of
from router.gateway.engines.base import EngineCall
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient
from router.gateway.upstream.answer import decode_answer


class PathLoadFailed(Exception):
    """The load or its check failed; the message says why."""


def steps(worker: Worker, entry: FleetVersionEntry) -> list[EngineCall] | None:
    """The calls that load ``entry``'s checkpoint into ``worker`` with the fleet's label (its engine's
    :meth:`~router.gateway.engines.base.Engine.reload_plan`); ``None`` when its engine has no way to, or the
    entry has no checkpoint."""
    engine = engine_of(worker)
    if entry.source_path is None or engine is None:
        return None
    try:
        return engine.reload_plan(worker, entry)
    except ValidationError:
        return None


async def load(client: WorkerClient, worker: Worker, plan: list[EngineCall], headers: dict[str, str]) -> None:
    """Run ``plan`` on ``worker`` in order; :class:`PathLoadFailed` at the first call that did not succeed."""
    engine = engine_of(worker)
    decode = engine.decode if engine is not None else decode_answer
    for step in plan:
        answer = await client.call(worker.url, step.endpoint, step.request, headers=headers, decode=decode)
        if answer.value is None or not answer.value.ok:
            why = answer.error or (answer.body.model_dump_json()[:300] if answer.body is not None else "no answer")
            raise PathLoadFailed(f"{step.endpoint.path} failed: {why}")


async def same_weights(client: WorkerClient, joiner: Worker, holder: Worker, headers: dict[str, str]) -> bool | None:
    """Whether ``joiner`` now holds the weights ``holder`` does, by the checksums their engine reports;
    ``None`` when they cannot be compared (another engine or layout, or no checksum answered)."""
    if joiner.engine != holder.engine or joiner.tp_size != holder.tp_size:
        return None
    engine = engine_of(joiner)
    if engine is None or engine.digest_request is None:
        return None
    ask = engine.digest_request
    answers = await asyncio.gather(
        *(client.call(w.url, ask[0], ask[1], headers=headers, decode=engine.decode) for w in (joiner, holder))
    )
    digests = [_digest(a.value) for a in answers]
    if any(d is None for d in digests):
        return None
    return digests[0] == digests[1]


def _digest(body: object) -> tuple[object, ...] | None:
    """What a checker answer says of the weights, in a form two answers compare by equality."""
    if isinstance(body, VllmWeightCheckerResult):
        return tuple(sorted(body.checksums.items())) if body.checksums else None
    if isinstance(body, WeightsCheckerResult):
        return tuple(body.checksums_per_rank()) or None
    return None
