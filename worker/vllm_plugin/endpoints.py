"""The vLLM endpoint plugin: this project's two-phase weight-sync routes on vLLM's API server.

Registered under ``vllm.endpoint_plugins`` as ``omni_router`` and loaded only when
``VLLM_PLUGINS`` names it. It adds ``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/prepare_weights_update``, ``/complete_weights_update`` and ``/abort_weights_update`` with exactly
the contract omni-worker serves (:mod:`router.contract.weight_sync`, :mod:`router.contract.endpoints`),
so a trainer or a router drives a vLLM server as it drives an omni-worker:

* A body is parsed once, here; a malformed one is a 400 ``{"error": {"message"}}`` and nothing
  reaches the engine. The ranks get the normalized body as a JSON string.
* Each call runs on every rank (``engine_client.collective_rpc`` of the worker extension,
  :mod:`worker.vllm_plugin.extension`), bounded by the endpoint's budget; the ranks' answers are
  merged (:mod:`worker.vllm_plugin.merge`): 200 when every rank succeeded, else 400 with
  ``error.message`` and ``weights`` saying what the call left the weights as.
* One weight-sync call at a time; a caller waiting behind another gets a 503 after 30 s (or its own
  ``timeout_s`` when shorter; 10 s for an abort), as on omni-worker.
* A prepare is refused (400, weights intact) unless generation is paused (vLLM's ``/pause``) or the
  body sets ``abort_all_requests``: then the plugin pauses vLLM itself (``abort`` mode, which aborts
  the requests in flight) and resumes it once the update ends (complete, abort, or its deadline),
  unless the weights were left partial. A complete while generation was resumed in between drops
  the update with the weights intact.
* ``/pause_generation`` and ``/continue_generation`` (SGLang's spelling, which the two-phase sync's
  trainers send) map onto vLLM's scheduler: ``abort`` → ``abort``, ``in_place`` → ``keep``, ``retract`` →
  ``keep`` then every running request preempted, so it recomputes its KV after the continue.
* A successful complete sets vLLM's own weight-version label (``update_weight_version``, what
  ``GET /weight_info`` reports) and resets the prefix cache, whose blocks hold the old weights' KV.

vLLM's plugin interface asks an endpoint plugin that needs a new worker-side method to pair with an
engine-side part; here that part is the worker extension, vLLM's mechanism for methods reached by
``collective_rpc``. Like vLLM's own RL routes, these routes are outside vLLM's ``--api-key`` (it
guards ``/v1`` and a few other prefixes only): serve them only where the trainer alone can reach them.
"""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from router.contract import endpoints as ep
from router.contract.admin import AdminResult, ContinueRequest, ContinueResult, PauseRequest, PauseResult
from router.contract.base import WireRequest, WireResponse
from router.contract.budget import APPLY_S, DEFAULT_RECEIVE_TIMEOUT_S, HOP_MARGIN_S
from router.contract.endpoint import Endpoint
from router.contract.errors import ApiError, error_body
from router.contract.web.parsing import decode_json, parse_model
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateRequest,
    CompleteWeightsUpdateResponse,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    WeightSyncResponse,
)
from worker.ranks import AdminBusy, held
from worker.transfer.group.receive_session import RECEIVE_GRACE_S
from worker.vllm_plugin.merge import merge_abort, merge_complete, merge_group, merge_prepare

log = logging.getLogger(__name__)

A = TypeVar("A", bound=WireResponse)
Call = Callable[[Any], Awaitable[WireResponse]]

#: How long a call waits for another weight-sync call to end (unless its own ``timeout_s`` is shorter).
LOCK_WAIT_S = HOP_MARGIN_S
#: An abort has no ``timeout_s``; it must not wait out a complete's whole receive to learn it cannot run.
ABORT_WAIT_S = 10.0


class OmniWeightSyncEndpoints:
    """The ``omni_router`` endpoint plugin (vLLM's ``EndpointPlugin`` protocol)."""

    name = "omni_router"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self._engine: Any = None
        self._lock = asyncio.Lock()
        self._holding = False
        """This plugin paused generation for the prepared update (``abort_all_requests``)."""
        self._hold_id = 0
        self._hold_expiry: asyncio.TimerHandle | None = None
        self._expiry_task: asyncio.Task[None] | None = None

    # -- vLLM's plugin protocol ----------------------------------------------------------------

    def attach_router(self, app: FastAPI) -> None:
        table: list[tuple[Endpoint[Any, Any], Call, bool]] = [
            (ep.INIT_WEIGHTS_UPDATE_GROUP, self._init, False),
            (ep.DESTROY_WEIGHTS_UPDATE_GROUP, self._destroy, True),
            (ep.PREPARE_WEIGHTS_UPDATE, self._prepare, False),
            (ep.COMPLETE_WEIGHTS_UPDATE, self._complete, False),
            (ep.ABORT_WEIGHTS_UPDATE, self._abort, True),
        ]
        for endpoint, call, allow_empty in table:
            app.add_api_route(
                endpoint.path, self._route(endpoint, call, allow_empty), methods=["POST"], summary=endpoint.summary
            )
        # SGLang's pause and continue, which the two-phase sync's trainers send: no weight-sync lock (they
        # change no weights, and a trainer pauses before it prepares).
        for endpoint, call in ((ep.PAUSE_GENERATION, self._pause), (ep.CONTINUE_GENERATION, self._continue)):
            app.add_api_route(
                endpoint.path, self._plain_route(endpoint, call), methods=["POST"], summary=endpoint.summary
            )

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        self._engine = engine_client

    # -- the routes ----------------------------------------------------------------------------

    def _route(self, endpoint: Endpoint[Any, Any], call: Call, allow_empty: bool) -> Callable[..., Any]:
        async def handle(request: Request) -> JSONResponse:
            try:
                req = _parse(endpoint.request, await request.body(), dict(request.query_params), allow_empty)
                if self._engine is None:
                    raise ApiError(503, "this server has no engine (the omni weight sync needs one)")
                wait_s = ABORT_WAIT_S if endpoint is ep.ABORT_WEIGHTS_UPDATE else LOCK_WAIT_S
                timeout_s = getattr(req, "timeout_s", None)
                wait_s = min(wait_s, timeout_s) if timeout_s else wait_s
                busy = f"{endpoint.name}: another weight-sync call is still running on this server (waited {wait_s:g}s)"
                async with held(self._lock, wait_s, busy):
                    response = await call(req)
            except ApiError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
            except AdminBusy as exc:
                return JSONResponse(error_body(str(exc)), status_code=503, headers={"Retry-After": "1"})
            return _answer(endpoint, response)

        handle.__name__ = f"omni_{endpoint.name}"
        return handle

    def _plain_route(self, endpoint: Endpoint[Any, Any], call: Call) -> Callable[..., Any]:
        async def handle(request: Request) -> JSONResponse:
            try:
                req = _parse(endpoint.request, await request.body(), dict(request.query_params), True)
                if self._engine is None:
                    raise ApiError(503, "this server has no engine")
                response = await call(req)
            except ApiError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
            return JSONResponse(response.model_dump(mode="json"))

        handle.__name__ = f"omni_{endpoint.name}"
        return handle

    async def _pause(self, req: PauseRequest) -> WireResponse:
        """SGLang's pause modes on vLLM's scheduler: ``abort`` is vLLM's ``abort``, ``in_place`` its ``keep``
        (running requests frozen with their KV), and ``retract`` its ``keep`` followed by preempting every
        running request (``reset_prefix_cache(reset_running_requests=True)``): their KV is dropped and they
        recompute it after the continue, with whatever weights are loaded then, as SGLang's retract does."""
        engine = self._engine
        await engine.pause_generation(mode="abort" if req.mode == "abort" else "keep")
        if req.mode == "retract" and not await engine.reset_prefix_cache(reset_running_requests=True):
            raise ApiError(500, "retract: vLLM could not preempt the running requests; generation stays paused")
        return PauseResult(message="Generation paused successfully.", pause_mode=req.mode)

    async def _continue(self, req: ContinueRequest) -> WireResponse:
        was_paused = await self._engine.is_paused()
        await self._engine.resume_generation()
        return ContinueResult(message="Generation continued successfully.", was_paused=was_paused)

    async def _init(self, req: InitWeightsUpdateGroupRequest) -> WireResponse:
        bound = ep.INIT_WEIGHTS_UPDATE_GROUP.worker_bound(req)
        answers = await self._ranks("omni_init_weights_update_group", req, bound, WeightSyncResponse)
        merged = merge_group(answers)
        if not merged.success and any(a.success for a in answers):
            # A group joined by only some ranks is of no use: those ranks leave it again.
            await self._destroy(DestroyWeightsUpdateGroupRequest(group_name=req.group_name))
        return merged

    async def _destroy(self, req: DestroyWeightsUpdateGroupRequest) -> WireResponse:
        bound = ep.DESTROY_WEIGHTS_UPDATE_GROUP.worker_bound(req)
        return merge_group(await self._ranks("omni_destroy_weights_update_group", req, bound, WeightSyncResponse))

    async def _prepare(self, req: PrepareWeightsUpdateRequest) -> WireResponse:
        engine = self._engine
        paused_here = False
        if not await engine.is_paused():
            if not req.abort_all_requests:
                return PrepareWeightsUpdateResponse(
                    status="error",
                    weights="intact",
                    message="generation is not paused: call /pause first (or set abort_all_requests to let this "
                    "server abort the requests in flight and pause itself for the update)",
                )
            await engine.pause_generation(mode="abort")
            self._hold(req.timeout_s or DEFAULT_RECEIVE_TIMEOUT_S)
            paused_here = True
        bound = ep.PREPARE_WEIGHTS_UPDATE.worker_bound(req)
        try:
            answers = await self._ranks("omni_prepare_weights_update", req, bound, PrepareWeightsUpdateResponse)
        except ApiError as exc:  # some ranks may have posted their receive: drop it everywhere
            await self._settle_failed_prepare(req.group_name, drop=True, lift=paused_here)
            exc.extra.setdefault("weights", "intact")  # a prepare writes nothing
            raise
        merged = merge_prepare(answers)
        if not merged.ok:
            # The ranks that are ready must not wait for a broadcast that will not come; when none is,
            # nothing of this prepare runs (and an update prepared before it is left alone).
            await self._settle_failed_prepare(req.group_name, drop=any(a.ok for a in answers), lift=paused_here)
        return merged

    async def _settle_failed_prepare(self, group_name: str, *, drop: bool, lift: bool) -> None:
        try:
            if drop:
                await self._drop_prepared(group_name)
        except ApiError as exc:
            log.error("dropping a failed prepare on every rank: %s", exc.message)
        finally:
            if lift:
                await self._lift_hold()

    async def _complete(self, req: CompleteWeightsUpdateRequest) -> WireResponse:
        engine = self._engine
        if not await engine.is_paused():
            dropped = await self._drop_prepared(req.group_name)
            await self._lift_hold()
            why = "the received weights were dropped" if dropped.success else dropped.message
            return CompleteWeightsUpdateResponse(
                success=False,
                weights="intact",
                weights_partial=dropped.weights_partial,
                message=f"generation is not paused (resumed after the prepare?): {why}; previous weights kept",
            )
        bound = ep.COMPLETE_WEIGHTS_UPDATE.worker_bound(req)
        merged = merge_complete(
            await self._ranks("omni_complete_weights_update", req, bound, CompleteWeightsUpdateResponse)
        )
        if merged.success:
            if merged.weight_version is not None:
                await engine.update_weight_version(merged.weight_version)
            merged.weight_version = await engine.get_weight_version()
            if not await engine.reset_prefix_cache():
                merged.message += " (the prefix cache could not be reset: requests frozen by a 'keep' pause hold KV)"
        if merged.weights != "partial" and not merged.weights_partial:
            await self._lift_hold()
        return merged

    async def _abort(self, req: AbortWeightsUpdateRequest) -> WireResponse:
        merged = await self._drop_prepared(req.group_name)
        if not merged.weights_partial:
            await self._lift_hold()
        return merged

    # -- helpers -------------------------------------------------------------------------------

    async def _ranks(self, method: str, req: WireRequest, bound: float, answer: type[A]) -> list[A]:
        """``method`` of the worker extension on every rank, each answer parsed as ``answer``."""
        body = req.to_json().decode()
        # Bounded here, not with collective_rpc's own ``timeout``: every rank method bounds its own waits,
        # and an executor that stops waiting for a rank leaves that rank's late answer in its queue.
        try:
            raw = await asyncio.wait_for(
                self._engine.collective_rpc(method, kwargs={"request": body}), bound + HOP_MARGIN_S
            )
        except TimeoutError:
            raise ApiError(504, f"{method} did not answer on every rank within {bound + HOP_MARGIN_S:g}s") from None
        except Exception as exc:
            log.exception("%s failed on the engine", method)
            hint = (
                " (is vLLM started with --worker-extension-cls worker.vllm_plugin.extension.OmniWeightSyncExtension?)"
            )
            raise ApiError(500, f"{method} failed on the engine: {type(exc).__name__}: {exc}{hint}") from None
        return [answer.model_validate_json(r) for r in raw]

    async def _drop_prepared(self, group_name: str) -> AbortWeightsUpdateResponse:
        req = AbortWeightsUpdateRequest(group_name=group_name)
        bound = ep.ABORT_WEIGHTS_UPDATE.worker_bound(req)
        return merge_abort(await self._ranks("omni_abort_weights_update", req, bound, AbortWeightsUpdateResponse))

    def _hold(self, window_s: float) -> None:
        """Generation was paused for this update: resumed when it ends, or once it could no longer complete."""
        self._holding = True
        self._hold_id += 1
        if self._hold_expiry is not None:
            self._hold_expiry.cancel()
        loop = asyncio.get_running_loop()
        life = window_s + RECEIVE_GRACE_S + APPLY_S
        self._hold_expiry = loop.call_later(life, self._on_hold_expiry, self._hold_id)

    def _on_hold_expiry(self, hold_id: int) -> None:
        self._expiry_task = asyncio.get_running_loop().create_task(self._expire_hold(hold_id))

    async def _expire_hold(self, hold_id: int) -> None:
        """The ranks have ended the update by now (their own expiry): generation resumes, after any call in flight."""
        try:
            async with held(self._lock, LOCK_WAIT_S, "ending an expired pause"):
                if self._holding and self._hold_id == hold_id:
                    log.warning("the prepared weight update was neither completed nor aborted; resuming generation")
                    self._hold_expiry = None
                    await self._lift_hold()
        except AdminBusy:  # a long call holds the lock: look again later
            self._hold_expiry = asyncio.get_running_loop().call_later(LOCK_WAIT_S, self._on_hold_expiry, hold_id)

    async def _lift_hold(self) -> None:
        if self._hold_expiry is not None:
            self._hold_expiry.cancel()
            self._hold_expiry = None
        if self._holding:
            self._holding = False
            await self._engine.resume_generation()


def _parse(model: type[WireRequest], raw: bytes, query: dict[str, str], allow_empty: bool) -> WireRequest:
    """The body as ``model`` (query parameters fill in missing fields, as on omni-worker), or a 400."""
    if not raw.strip():
        if not allow_empty:
            raise ApiError(400, "request body is required")
        data: Any = {}
    else:
        data = decode_json(raw)
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    for key, value in query.items():
        data.setdefault(key, value)
    return parse_model(model, data)


def _answer(endpoint: Endpoint[Any, Any], model: WireResponse) -> JSONResponse:
    """200 with the response model, or 400 with it and ``error.message`` when it reports a failure."""
    if isinstance(model, (AdminResult, PrepareWeightsUpdateResponse)):
        update: dict[str, object] = {"weights_partial": bool(model.weights_partial)}
        if model.weights is None and not endpoint.writes_weights:
            update["weights"] = "intact"
        model = model.model_copy(update=update)
        if not model.ok:
            model = model.failed(model.message)
    return JSONResponse(model.model_dump(mode="json"), status_code=200 if model.ok else 400)
