"""Targeted admin operations: which workers a call names (``?workers=`` and/or ``?selector=``), resolved once.

A weight-changing or pause call may name a subset of the fleet; the rest keeps generating on the
weights it has. The target set rides in the query, never in the body, because SGLang's bodies are
forwarded to the workers as the caller set them: :data:`TARGET_PARAMS` are taken out of the query
before the body is parsed and before the query is forwarded, so the worker wire is unchanged.

- ``workers``: ids or URLs, comma-separated or repeated; an unknown one is a 404
  (``worker_not_found``) before anything is locked, fenced or sent.
- ``selector``: :mod:`router.gateway.admin.selectors`, matched over each candidate's facts
  (:class:`WorkerFacts`: the registry's record and the worker's ``/model_info``, read now).
- both: the named workers that the selector matches. An empty selection is a 400
  (``no_workers_match``) that changes nothing.

The resolved ids travel with the call (:attr:`~router.gateway.admin.fanout.AdminCall.only`); the
operation picks its live targets among them under the update lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from multidict import MultiMapping

from router.contract import endpoints as ep
from router.contract.admin import ModelInfo
from router.contract.rl import RlCapabilities, RlRefusal
from router.gateway.admin.selectors import Selector, SelectorError, parse_selector
from router.gateway.engines import engine_of, serves
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.upstream import WorkerClient

#: The query parameters that choose targets; never forwarded to a worker.
TARGET_PARAMS = frozenset({"workers", "selector"})
#: smg's dialect and capabilities of a worker whose engine is not known yet.
UNKNOWN_DIALECT = "unknown"
NO_CAPABILITIES = RlCapabilities(source="static")


@dataclass(frozen=True, slots=True)
class TargetQuery:
    """The target set a call names; ``given`` is False for a call to the whole fleet."""

    workers: tuple[str, ...] = ()
    selector: Selector | None = None

    @property
    def given(self) -> bool:
        return bool(self.workers) or self.selector is not None


def target_query(query: MultiMapping[str], *, selector_required: bool = False) -> TargetQuery:
    """Read :data:`TARGET_PARAMS` from ``query`` (400 ``selector_required`` / ``invalid_selector``)."""
    names = tuple(name.strip() for raw in query.getall("workers", ()) for name in raw.split(",") if name.strip())
    texts = query.getall("selector", ())
    if not texts:
        if selector_required:
            raise RlRefusal(400, "selector_required", "a fan-out needs ?selector=... (for example engine=sglang)")
        return TargetQuery(names, None)
    if len(texts) > 1:
        raise RlRefusal(400, "invalid_selector", "give ?selector= once (join clauses with commas)")
    try:
        selector = parse_selector(texts[0])
    except SelectorError as exc:
        raise RlRefusal(400, "invalid_selector", f"invalid selector {texts[0][:200]!r}: {exc}") from None
    return TargetQuery(names, selector)


def without_targets(query: MultiMapping[str]) -> dict[str, str]:
    """The query a worker may see: everything but :data:`TARGET_PARAMS` (the last value of each name)."""
    return {k: v for k, v in query.items() if k not in TARGET_PARAMS}


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """One worker as the RL API and the selector see it: the registry's record and its ``/model_info``."""

    worker: Worker
    routable: bool
    pending: str | None
    info: ModelInfo | None
    """``None`` when the worker is dead or did not answer ``/model_info`` now."""

    @property
    def model_id(self) -> str:
        if self.info is None:
            return "unknown"
        return self.info.served_model_name or self.info.model_path

    @property
    def control(self) -> str | None:
        """smg's control state: ``asleep`` (weights released), ``paused`` or ``active``; ``None`` unknown."""
        info = self.info
        if info is None:
            return None
        if info.weights_released or info.weight_state == "released":
            return "asleep"
        return "paused" if info.is_paused else "active"

    @property
    def health(self) -> str:
        """smg's health words: ``ready`` for a worker that may take traffic, else ``not_ready`` (or ``dead``)."""
        if self.worker.is_dead:
            return "dead"
        return "ready" if self.worker.health == "healthy" else "not_ready"

    @property
    def weight_version(self) -> str | None:
        return self.info.weight_version if self.info is not None else self.worker.weight_version

    @property
    def tp_size(self) -> int | None:
        return self.info.tp_size if self.info is not None else self.worker.tp_size

    @property
    def rl_dialect(self) -> str:
        """smg's ``engine``: the admin dialect the worker speaks (``unknown`` while its engine is not known)."""
        engine = engine_of(self.worker)
        return engine.rl_dialect if engine is not None else UNKNOWN_DIALECT

    @property
    def rl_capabilities(self) -> RlCapabilities:
        """What the worker's engine can do for RL control (no capability claimed while it is not known)."""
        engine = engine_of(self.worker)
        return engine.rl_capabilities if engine is not None else NO_CAPABILITIES

    def selector_facts(self) -> dict[str, str | None]:
        """The values a selector clause compares (absent facts are ``None``)."""
        tp = self.tp_size
        return {
            "id": self.worker.id,
            "engine": self.rl_dialect,
            "role": None,
            "model": self.model_id if self.info is not None else None,
            "model_id": self.model_id if self.info is not None else None,
            "tp_size": str(tp) if tp is not None else None,
            "dp_size": "1",
            "pp_size": "1",
            "weight_version": self.weight_version,
            "control": self.control,
            "health": self.health,
        }

    def labels(self) -> dict[str, str]:
        """omni's routing state, as labels beside smg's fields."""
        labels = {
            "omni.health": self.worker.health,
            "omni.disabled": str(self.worker.disabled).lower(),
            "omni.routable": str(self.routable).lower(),
            "omni.source": self.worker.source,
            "omni.engine": self.worker.engine or "unknown",
        }
        if self.pending is not None:
            labels["omni.pending"] = self.pending
        if self.info is not None and self.info.weight_state is not None:
            labels["omni.weight_state"] = self.info.weight_state
        return labels


class FleetFacts:
    """Reads :class:`WorkerFacts` for the workers asked about (one ``/model_info`` each, all at once)."""

    def __init__(self, registry: WorkerRegistry, client: WorkerClient, headers: dict[str, str], timeout_s: float):
        self._registry = registry
        self._client = client
        self._headers = headers
        self._timeout_s = timeout_s

    async def read(self, workers: Sequence[Worker]) -> list[WorkerFacts]:
        infos = await asyncio.gather(*(self._info(w) for w in workers))
        return [
            WorkerFacts(w, self._registry.is_routable(w), self._registry.pending_reason(w), info)
            for w, info in zip(workers, infos, strict=True)
        ]

    async def _info(self, worker: Worker) -> ModelInfo | None:
        if worker.is_dead or not serves(worker, ep.MODEL_INFO.path):
            return None  # vLLM has no /model_info: its facts are the registry's
        answer = await self._client.call(worker.url, ep.MODEL_INFO, headers=self._headers, cap_s=self._timeout_s)
        return answer.value

    def named(self, names: Sequence[str]) -> list[Worker]:
        """The workers ``names`` give (ids or URLs), in registry order; 404 ``worker_not_found`` for any other."""
        found: dict[str, Worker] = {}
        for name in names:
            worker = self._registry.find(name)
            if worker is None:
                raise RlRefusal(404, "worker_not_found", f"no worker with id or url {name[:200]!r}")
            found[worker.id] = worker
        return [w for w in self._registry if w.id in found]

    async def resolve(self, query: TargetQuery) -> list[Worker] | None:
        """The workers ``query`` selects (``None``: it names none, the whole fleet); 400 when none match."""
        if not query.given:
            return None
        candidates = self.named(query.workers) if query.workers else list(self._registry)
        if query.selector is not None:
            selector = query.selector
            candidates = [f.worker for f in await self.read(candidates) if selector.matches(f.selector_facts())]
        if not candidates:
            raise RlRefusal(400, "no_workers_match", f"no registered worker matches {_describe(query)}")
        return candidates


def _describe(query: TargetQuery) -> str:
    parts: list[str] = []
    if query.workers:
        parts.append(f"workers={','.join(query.workers)[:200]}")
    if query.selector is not None:
        parts.append(f"selector={query.selector.text[:200]!r}")
    return " and ".join(parts)


def only_ids(workers: Sequence[Worker] | None) -> frozenset[str] | None:
    return None if workers is None else frozenset(w.id for w in workers)
