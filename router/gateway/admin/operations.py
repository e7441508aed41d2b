"""The admin routes the router broadcasts, and how each one is treated.

One row per worker admin route; the route's shape (methods, request and response
models) and its timeout budget come from :mod:`router.contract.endpoints`, the
rows add the router's policy:

- ``locked`` (the endpoint is *serialized*): one at a time under the admin update lock;
- ``fenced``: the targets are also taken out of request routing for the whole
  broadcast, journaled, and kept disabled unless every target succeeds;
- ``changes_weights``: afterwards the targets that succeeded define the fleet's weights
  (:mod:`router.gateway.fleet.weights`); every other worker is pending until an update reaches it;
- ``in_group``: sent over a weight-update group, so refused (409) when the fleet no longer matches
  the group's members (:mod:`router.gateway.fleet.groups`); ``ends_group``: goes to the group's
  members only, and the router forgets the group afterwards.

A call may target a subset of the fleet (:mod:`router.gateway.admin.targets`) unless its state spans
every member of a weight-update group or of a held update (:attr:`Operation.targetable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from router.contract import areal_endpoints as aep
from router.contract import endpoints as ep
from router.contract import lora_endpoints as lep
from router.contract.base import WireRequest, WireResponse
from router.contract.endpoint import Endpoint
from router.contract.fleet_answers import (
    AbortRequestsFleetAnswer,
    CompleteFleetAnswer,
    FleetAnswer,
    GroupInitFleetAnswer,
    IsPausedFleetAnswer,
    IsSleepingFleetAnswer,
    PauseFleetAnswer,
    PrepareFleetAnswer,
    ResetPrefixCacheFleetAnswer,
    ServerInfoFleetAnswer,
    VllmWeightCheckerFleetAnswer,
    WeightsCheckerFleetAnswer,
    WeightTransferFleetAnswer,
    WeightTransferInitFleetAnswer,
)

#: Covariant, as :class:`~router.contract.endpoint.Endpoint` is: the table holds operations of every route.
Req = TypeVar("Req", bound=WireRequest, covariant=True)
Resp = TypeVar("Resp", bound=WireResponse, covariant=True)


@dataclass(frozen=True, slots=True)
class Operation(Generic[Req, Resp]):
    """One worker admin route and how the router treats it: its calls send a ``Req`` and each
    worker answers a ``Resp`` (:class:`~router.contract.fleet_answers.WorkerResult` ``[Resp]`` after a fan-out)."""

    endpoint: Endpoint[Req, Resp]
    fenced: bool = False
    changes_weights: bool = False
    loads_weights: bool = False
    """It brings new tensors (not a relabel or a memory resume): ``--verify-updates changed`` checks that they
    changed the weights."""
    in_group: bool = False
    ends_group: bool = False
    text_answers: bool = False
    """Every engine answers the route in plain text (vLLM's LoRA routes, which omni-worker answers as vLLM
    does): its answers are read as :func:`~router.gateway.upstream.answer.decode_plain` reads them."""
    answer: type[FleetAnswer[Resp]] | None = None
    """The router's answer model; by default the worker's answer lifted to the fleet."""

    @property
    def path(self) -> str:
        return self.endpoint.path

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def locked(self) -> bool:
        return self.endpoint.serialized

    @property
    def targetable(self) -> bool:
        """Whether a call may go to a chosen subset of the fleet (:mod:`router.gateway.admin.targets`): not
        one over a weight-update group (its members are its targets) nor one step of a held update."""
        return not (self.in_group or self.ends_group or self.path in _FLEET_WIDE)

    def answer_model(self) -> type[FleetAnswer[Resp]]:
        return self.answer if self.answer is not None else parametrized(FleetAnswer, self.endpoint.response)

    def router_wait(self, req: WireRequest) -> float:
        """How long the router waits for one worker's answer to ``req`` (the budget plus one margin)."""
        return self.endpoint.budget.router_wait(self.endpoint.timeout_of(req))


_PARAMETRIZED: dict[tuple[type[Any], type[Any]], type[Any]] = {}


def parametrized(generic: type[Any], arg: type[Any]) -> type[Any]:
    """``generic[arg]`` for a pydantic generic model, built once per process.

    Pydantic keeps the classes it parametrizes only weakly: one built per call is built again (its
    whole schema, about a millisecond) whenever the collector has freed the last one, which a
    broadcast answered hundreds of times a second hits on most calls.
    """
    made = _PARAMETRIZED.get((generic, arg))
    if made is None:
        made = _PARAMETRIZED[(generic, arg)] = generic[arg]
    return made


#: An operation of any route (what :data:`OPERATIONS` holds).
AnyOperation = Operation[WireRequest, WireResponse]

#: Steps whose state spans every member of a group or a held update, whatever the caller names.
_FLEET_WIDE = frozenset(
    e.path
    for e in (
        ep.INIT_WEIGHTS_UPDATE_GROUP,
        ep.COMPLETE_WEIGHTS_UPDATE,
        ep.ABORT_WEIGHTS_UPDATE,
        ep.INIT_WEIGHT_TRANSFER_ENGINE,
        ep.UPDATE_WEIGHTS,
        ep.FINISH_WEIGHT_UPDATE,
        *lep.LORA_ADMIN,
    )
)

# The operations policy code names, typed by their route's request and answer.
INIT_GROUP = Operation(ep.INIT_WEIGHTS_UPDATE_GROUP, fenced=True, answer=GroupInitFleetAnswer)
PREPARE = Operation(ep.PREPARE_WEIGHTS_UPDATE, fenced=True, in_group=True, answer=PrepareFleetAnswer)
# Run inside the update a ready prepare holds the lock for (see two_phase).
COMPLETE = Operation(ep.COMPLETE_WEIGHTS_UPDATE, changes_weights=True, loads_weights=True, answer=CompleteFleetAnswer)
ABORT = Operation(ep.ABORT_WEIGHTS_UPDATE)
# vLLM's weight-transfer API (see weight_transfer): init as /init_weights_update_group; start holds the lock
# and the fence until the finish; update_weights runs inside that update.
INIT_WEIGHT_TRANSFER = Operation(ep.INIT_WEIGHT_TRANSFER_ENGINE, fenced=True, answer=WeightTransferInitFleetAnswer)
START = Operation(ep.START_WEIGHT_UPDATE, fenced=True, in_group=True, answer=WeightTransferFleetAnswer)
UPDATE = Operation(ep.UPDATE_WEIGHTS, answer=WeightTransferFleetAnswer)
FINISH = Operation(ep.FINISH_WEIGHT_UPDATE, changes_weights=True, loads_weights=True, answer=WeightTransferFleetAnswer)
PAUSE = Operation(ep.PAUSE, fenced=True, answer=PauseFleetAnswer)
RESUME = Operation(ep.RESUME, answer=PauseFleetAnswer)
IS_PAUSED = Operation(ep.IS_PAUSED, answer=IsPausedFleetAnswer)
IS_SLEEPING = Operation(ep.IS_SLEEPING, answer=IsSleepingFleetAnswer)
ABORT_REQUESTS = Operation(ep.ABORT_REQUESTS, answer=AbortRequestsFleetAnswer)
MODEL_INFO = Operation(ep.MODEL_INFO)
GET_WEIGHT_VERSION = Operation(ep.GET_WEIGHT_VERSION)
SERVER_INFO = Operation(ep.SERVER_INFO, answer=ServerInfoFleetAnswer)
WEIGHTS_CHECKER = Operation(ep.WEIGHTS_CHECKER, answer=WeightsCheckerFleetAnswer)
RESET_PREFIX_CACHE = Operation(ep.RESET_PREFIX_CACHE, answer=ResetPrefixCacheFleetAnswer)
WEIGHT_INFO = Operation(ep.WEIGHT_INFO)
WEIGHT_CHECKER = Operation(ep.WEIGHT_CHECKER, answer=VllmWeightCheckerFleetAnswer)
# Any worker method: a weight update unless the method only reads (COLLECTIVE_RPC_READ).
COLLECTIVE_RPC = Operation(ep.COLLECTIVE_RPC, fenced=True, changes_weights=True, loads_weights=True)
SHUTDOWN_WEIGHT_TRANSFER_ENGINE = Operation(ep.SHUTDOWN_WEIGHT_TRANSFER_ENGINE)
# LoRA adapters, all or nothing across the fleet (router.gateway.sync.adapters): serialized, not fenced (a
# failure keeps the adapter, not the worker, out of routing).
LORA_LOAD = Operation(lep.LOAD_LORA_ADAPTER)
LORA_LOAD_TENSORS = Operation(lep.LOAD_LORA_ADAPTER_FROM_TENSORS)
LORA_UNLOAD = Operation(lep.UNLOAD_LORA_ADAPTER)
V1_LORA_LOAD = Operation(lep.V1_LOAD_LORA_ADAPTER, text_answers=True)
V1_LORA_UNLOAD = Operation(lep.V1_UNLOAD_LORA_ADAPTER, text_answers=True)

OPERATIONS: dict[str, AnyOperation] = {
    op.path: op
    for op in (
        # Fleet-changing: one at a time, targets fenced, fail closed.
        Operation(ep.PAUSE_GENERATION, fenced=True),
        Operation(ep.UPDATE_WEIGHTS_FROM_DISK, fenced=True, changes_weights=True, loads_weights=True),
        Operation(ep.UPDATE_WEIGHTS_FROM_TENSOR, fenced=True, changes_weights=True, loads_weights=True),
        Operation(
            ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED, fenced=True, changes_weights=True, loads_weights=True, in_group=True
        ),
        INIT_GROUP,
        Operation(ep.DESTROY_WEIGHTS_UPDATE_GROUP, fenced=True, ends_group=True),
        PREPARE,
        Operation(ep.UPDATE_WEIGHT_VERSION, fenced=True, changes_weights=True),
        Operation(ep.RELEASE_MEMORY_OCCUPATION, fenced=True),
        Operation(ep.RESUME_MEMORY_OCCUPATION, fenced=True, changes_weights=True),
        # vLLM's sleep and wake: a pause and a memory release, a memory resume and a continue.
        Operation(ep.SLEEP, fenced=True),
        Operation(ep.WAKE_UP, fenced=True, changes_weights=True),
        # Serialized with updates (resuming mid-update would serve partial weights) but not fenced.
        Operation(ep.CONTINUE_GENERATION),
        # SGLang 0.5.23's update bracket (miles sends it): serialized with updates, changes nothing.
        Operation(ep.BEGIN_WEIGHT_UPDATE),
        Operation(ep.END_WEIGHT_UPDATE),
        COMPLETE,
        ABORT,
        INIT_WEIGHT_TRANSFER,
        START,
        UPDATE,
        FINISH,
        PAUSE,
        RESUME,
        IS_PAUSED,
        IS_SLEEPING,
        # Plain broadcasts.
        Operation(ep.FLUSH_CACHE),
        RESET_PREFIX_CACHE,
        Operation(ep.ABORT_REQUEST),
        ABORT_REQUESTS,
        GET_WEIGHT_VERSION,
        SERVER_INFO,
        WEIGHTS_CHECKER,
        MODEL_INFO,
        # vLLM's routes that only vLLM servers serve.
        WEIGHT_INFO,
        WEIGHT_CHECKER,
        COLLECTIVE_RPC,
        SHUTDOWN_WEIGHT_TRANSFER_ENGINE,
        LORA_LOAD,
        LORA_LOAD_TENSORS,
        LORA_UNLOAD,
        V1_LORA_LOAD,
        V1_LORA_UNLOAD,
    )
}
#: ``/collective_rpc`` of a method known to leave the weights as they are: serialized, not fenced.
COLLECTIVE_RPC_READ = Operation(ep.COLLECTIVE_RPC)
# AReaL's vLLM server's pause and continue (router.gateway.api.areal): the fleet's pause (fenced) and continue,
# each worker sent the route its engine serves for them. Not in the table: no engine but AReaL's own server
# serves these paths, so they are never broadcast as they came.
AREAL_PAUSE = Operation(aep.AREAL_PAUSE_GENERATION, fenced=True)
AREAL_CONTINUE = Operation(aep.AREAL_CONTINUE_GENERATION)
