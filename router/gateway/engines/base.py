"""What the router needs to know of one kind of inference server, behind one small class per engine.

The fleet logic (health thresholds, the update lock, fences, the journal, the version record,
routing) is the same for every worker; what differs by engine is only how the router *reads* a
worker and which of the router's routes the worker serves:

- **health**: which path a probe reads and what counts as an answer (omni-worker's ``/health`` is
  JSON; vLLM's and SGLang's are an empty 200);
- **metadata**: where the weight version, the process identity, the ranks a worker holds in a
  weight-update group and the memory state come from (:meth:`Engine.describe`);
- **answers**: how an admin answer is decoded into its contract model (SGLang and vLLM answer some
  routes with an empty body, ``null`` or plain text: :func:`~router.gateway.upstream.answer.decode_plain`);
- **digest**: the call whose answer says which weights a worker holds (:attr:`Engine.digest_request`,
  folded into one string by :func:`router.contract.weight_digest.of_checker_answer`);
- **routes**: the admin and generation routes its servers serve. The router sends a worker only
  routes its engine serves, so a mixed fleet can use exactly the routes every engine in it serves
  (a call that some target's engine lacks is refused before anything is locked, fenced or sent);
- **translations**: the call that stands, on its servers, for a route some trainer sends that the engine
  does not serve itself (AReaL's vLLM server's pause and continue: :meth:`Engine.generation_control`);
- **catch-up**: how a joiner loads the fleet's checkpoint (:meth:`Engine.reload_plan`) and whether it can
  give its weights to a peer (:attr:`Engine.peer_source`);
- **RL API**: the dialect and the capabilities smg's ``/v1/rl`` API reports for its workers
  (:attr:`Engine.rl_dialect`, :attr:`Engine.rl_capabilities`).

Nothing outside this package compares an engine's name: what differs by engine is asked of its class.

Each engine is a stateless singleton (:mod:`router.gateway.engines`); what it learns about a
worker is written on the :class:`~router.gateway.fleet.registry.Worker`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from urllib.parse import urlencode

from router.contract import endpoints as ep
from router.contract.admin import (
    ContinueRequest,
    HealthStatus,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)
from router.contract.base import WireRequest
from router.contract.endpoint import AnyEndpoint
from router.contract.fleet import EngineName, FleetVersionEntry
from router.contract.lora import LoadLoraAdapterRequest, VllmLoadLoraAdapterRequest
from router.contract.lora_endpoints import LOAD_LORA_ADAPTER, V1_LOAD_LORA_ADAPTER
from router.contract.rl import RlCapabilities
from router.contract.vllm import EmptyVllmRequest, PauseQuery
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient
from router.gateway.upstream.answer import Decoder, decode_plain

HEALTH_PATH = "/health"
#: SGLang's and omni-worker's weights checker asked for the checksums of the weights served.
CHECKSUM_OF_WEIGHTS: tuple[AnyEndpoint, WireRequest] = (ep.WEIGHTS_CHECKER, WeightsCheckerRequest(action="checksum"))


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One admin call as an engine's servers take it: the route and its request."""

    endpoint: AnyEndpoint
    request: WireRequest

    @property
    def query(self) -> str:
        """The request as a query string where the route reads its arguments there (vLLM's ``/pause``)."""
        if not self.endpoint.query_params:
            return ""
        fields = self.request.model_dump(mode="json", exclude_unset=True)
        return urlencode({k: str(v).lower() if isinstance(v, bool) else v for k, v in fields.items()})


#: AReaL's vLLM server's pause (vLLM's engine paused with every request aborted and its cache dropped) and
#: continue, in vLLM's own routes: ``/pause?mode=abort&clear_cache=true`` is that same engine call.
VLLM_ABORTING_PAUSE = EngineCall(ep.PAUSE, PauseQuery(mode="abort", clear_cache=True))
VLLM_RESUME = EngineCall(ep.RESUME, EmptyVllmRequest())
#: The same in SGLang's routes: an ``abort`` pause aborts every request and flushes the cache.
SGLANG_ABORTING_PAUSE = EngineCall(ep.PAUSE_GENERATION, PauseRequest(mode="abort"))
SGLANG_CONTINUE = EngineCall(ep.CONTINUE_GENERATION, ContinueRequest())


#: smg's static capability row of a server speaking SGLang's dialect (SGLang's, and omni-worker's).
SGLANG_RL_CAPABILITIES = RlCapabilities(
    source="static",
    pause_modes=["abort", "retract", "in_place"],
    update_from=["disk", "tensor", "distributed"],
    abort=True,
    flush_cache=True,
    sleep_wake=True,
    reports_weight_version=True,
)


def relabel(label: str) -> EngineCall:
    """The fleet's label set on weights a worker already loaded, without aborting its requests (SGLang's relabel
    aborts every request by default)."""
    return EngineCall(ep.UPDATE_WEIGHT_VERSION, UpdateWeightVersionRequest(new_version=label, abort_all_requests=False))


def load_from_disk(entry: FleetVersionEntry) -> list[EngineCall]:
    """SGLang's and omni-worker's load of ``entry``'s checkpoint with its label in one call, requests kept."""
    fields: dict[str, object] = {"model_path": entry.source_path, "abort_all_requests": False}
    if entry.weight_version is not None:
        fields["weight_version"] = entry.weight_version
    return [EngineCall(ep.UPDATE_WEIGHTS_FROM_DISK, UpdateWeightsFromDiskRequest.model_validate(fields))]


class Engine(ABC):
    """One kind of inference server (subclasses set the class attributes and :meth:`describe`)."""

    name: EngineName
    admin_paths: frozenset[str]
    """The router's admin routes this engine's servers serve (before capabilities found per worker)."""
    generation_paths: frozenset[str]
    """The generation routes the proxy may send to it."""
    reports_update_state: bool = False
    """Its ``/health`` says whether a prepared receive or an open update is alive (omni-worker's does): a held
    update reads it to end early. For other engines only an unanswered probe or the update's window ends it."""
    decode: Decoder = staticmethod(decode_plain)
    reports_adapter_digest: bool = False
    """Its answer to a LoRA load reports a digest of the tensors it loaded (omni-worker's ``lora_checksum``), so a
    trainer's ``X-Expected-Weights-Checksum`` can be checked on it."""
    digest_request: tuple[AnyEndpoint, WireRequest] | None = None
    """The admin call that reports the weights a worker serves (a checker's ``checksum``); ``None``: none."""
    peer_source: bool = False
    """Its servers stream their weights to a joiner of the same engine (omni-worker's snapshot stream behind
    ``/update_weights_from_peer``); the others catch up from the fleet's checkpoint only."""
    rl_dialect: str
    """smg's ``engine`` for its workers: the admin dialect they speak (omni-worker speaks SGLang's first)."""
    rl_capabilities: RlCapabilities
    """What its servers can do for RL control, as smg's static capability rows say it."""

    def health_path(self, worker: Worker) -> str:
        """The path a probe reads (SGLang's ``/health`` parks while generation is paused)."""
        return HEALTH_PATH

    async def health(
        self, client: WorkerClient, worker: Worker, timeout_s: float, headers: dict[str, str]
    ) -> HealthStatus | None:
        """One probe: the worker's state when it serves (what it says of its weights, if it says anything),
        ``None`` when it gave no usable answer. vLLM and SGLang answer any 2xx when they serve. ``/health`` is
        open on every engine and is probed without credentials; a route that stands in for it (SGLang's
        ``/model_info`` while paused) gets ``headers``, the router's own worker key."""
        path = self.health_path(worker)
        sent = {} if path == HEALTH_PATH else headers
        status = await client.status(worker.url, path, headers=sent, timeout_s=timeout_s)
        if status is None or not 200 <= status < 300:
            return None
        return HealthStatus(status="ok")

    @abstractmethod
    async def describe(self, client: WorkerClient, worker: Worker, headers: dict[str, str], timeout_s: float) -> bool:
        """Read the worker's weight version, process identity, group ranks and memory state onto ``worker``;
        False when it did not answer. Every read is bounded by ``timeout_s`` (a probe round waits for it)."""

    def reload_plan(self, worker: Worker, entry: FleetVersionEntry) -> list[EngineCall] | None:
        """The calls that load ``entry``'s checkpoint into ``worker`` under the fleet's label (a catch-up from a
        path, :mod:`router.gateway.catch_up.from_path`); ``None`` when its server has no way to."""
        return None

    def lora_load_route(self, worker: Worker) -> AnyEndpoint | None:
        """The route that loads a LoRA adapter from a path into ``worker``: SGLang's where it serves it, else
        vLLM's; ``None`` when it serves neither."""
        paths = self.admin_paths_of(worker)
        for route in (LOAD_LORA_ADAPTER, V1_LOAD_LORA_ADAPTER):
            if route.path in paths:
                return route
        return None

    def lora_load(self, worker: Worker, name: str, path: str) -> EngineCall | None:
        """The call that loads LoRA adapter ``name`` from ``path`` into ``worker`` (a catch-up; vLLM's loads in
        place); ``None`` when its server takes no such load."""
        route = self.lora_load_route(worker)
        if route is LOAD_LORA_ADAPTER:
            return EngineCall(route, LoadLoraAdapterRequest(lora_name=name, lora_path=path))
        if route is V1_LOAD_LORA_ADAPTER:
            return EngineCall(route, VllmLoadLoraAdapterRequest(lora_name=name, lora_path=path, load_inplace=True))
        return None

    def discards_weights(self, path: str, request: object) -> bool:
        """Whether a successful ``path`` call with ``request`` leaves the server's weights unknown once its memory
        is restored (a sleep or release that frees them without a copy). The router then keeps the worker out
        of rotation after the wake until it loads the fleet's weights again (an update, or a catch-up). An
        engine whose servers report their own weight state (omni-worker) needs none of this."""
        return False

    def generation_control(self, worker: Worker, *, pause: bool) -> EngineCall:
        """The call that pauses generation on ``worker`` as AReaL's vLLM server's pause does (every running and
        waiting request aborted, the cache dropped), or continues it (``pause=False``)."""
        return VLLM_ABORTING_PAUSE if pause else VLLM_RESUME

    def admin_paths_of(self, worker: Worker) -> frozenset[str]:
        """The admin routes this worker serves: the engine's, or what :meth:`describe` found it serves."""
        return worker.admin_paths if worker.admin_paths is not None else self.admin_paths
