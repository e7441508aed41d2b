"""The router's per-engine rules, driven directly or in-process (no worker process is needed to prove them):
decoding SGLang's and vLLM's bodies, detecting an engine from its answers, the routes each engine serves
(admin calls refused before anything is sent, generation routed only where served), the checkpoint a
fleet version can be read from again, and the calls that load it into a joiner of each engine.

What real servers answer is proven in the engine tier (``make test-engines``: real vLLM servers, and
SGLang 0.5.23's own routes over a stand-in engine)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.contract import endpoints as ep
from router.contract.admin import (
    AbortRequestResult,
    FlushCacheResult,
    MemoryOccupationRequest,
    MemoryOccupationResult,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
)
from router.contract.areal_endpoints import AREAL_CONTINUE_GENERATION, AREAL_PAUSE_GENERATION
from router.contract.errors import BadRequest, NotFound
from router.contract.fleet import FleetVersionEntry
from router.contract.sglang_server import SglangServerIdentity
from router.contract.version_policy import LATEST_ONLY
from router.contract.vllm_dev import SleepQuery
from router.contract.vllm_rl import CollectiveRpcRequest, CollectiveRpcResult, VllmServerIdentity, WeightInfo
from router.contract.weight_sync import PrepareWeightsUpdateRequest
from router.gateway.catch_up import from_path
from router.gateway.discovery.k8s import ENGINE_LABEL, PodWorker, pod_engine
from router.gateway.discovery.reconcile import DiscoveredFleet
from router.gateway.engines import ENGINES, detect, engine_of, refuse_unserved, serves
from router.gateway.engines.vllm import AREAL_SERVER_ADMIN, VLLM_ADMIN
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.fleet.weights import checkpoint_of
from router.gateway.routing import version_policy
from router.gateway.upstream import WorkerClient
from router.gateway.upstream.answer import decode_plain

# -- answers without JSON (SGLang 0.5.23's and vLLM 0.32's exact bodies)


def test_sglang_and_vllm_successes_without_json_are_typed_successes() -> None:
    flushed = decode_plain(FlushCacheResult, 200, b"Cache flushed.\nPlease check backend logs for more details.\n")
    assert flushed.value is not None and flushed.value.ok and flushed.value.message.startswith("Cache flushed.")
    aborted = decode_plain(AbortRequestResult, 200, b"")
    assert aborted.value is not None and aborted.value.ok and aborted.value.num_aborted == 0
    released = decode_plain(MemoryOccupationResult, 200, b"null")
    assert released.value is not None and released.value.ok
    rpc = decode_plain(CollectiveRpcResult, 200, b"")
    assert rpc.value is not None and rpc.value.results is None


def test_a_refusal_or_a_wrong_object_stays_an_error() -> None:
    refused = decode_plain(FlushCacheResult, 400, b"Flush cache failed.\n")
    assert refused.value is None and refused.error == "answered 400: Flush cache failed."
    wrong = decode_plain(FlushCacheResult, 200, b'{"success": "maybe"}')
    assert wrong.value is None and wrong.error is not None and "not a valid FlushCacheResult" in wrong.error
    # A read must say something: an empty /weight_info is no answer.
    empty = decode_plain(WeightInfo, 200, b"")
    assert empty.value is None and empty.error == "answered 200 with an empty body"
    vllm_error = decode_plain(WeightInfo, 500, b'{"error": {"message": "Call to collective_rpc method failed"}}')
    assert vllm_error.value is None and vllm_error.error == "Call to collective_rpc method failed"


def test_engine_identities() -> None:
    vllm = VllmServerIdentity.model_validate(
        {"vllm_config": {"instance_id": 1795791045358166801, "parallel_config": {"tensor_parallel_size": 2}}}
    )
    assert (
        vllm.vllm_config.instance_id == "1795791045358166801"
        and vllm.vllm_config.parallel_config.tensor_parallel_size == 2
    )
    first = SglangServerIdentity.model_validate({"startup_time": {"load_weights": 1.25, "cuda_graph": {"a": 0.5}}})
    again = SglangServerIdentity.model_validate({"startup_time": {"cuda_graph": {"a": 0.5}, "load_weights": 1.25}})
    restarted = SglangServerIdentity.model_validate({"startup_time": {"load_weights": 1.5, "cuda_graph": {"a": 0.5}}})
    assert first.instance_id() == again.instance_id() != restarted.instance_id()
    assert SglangServerIdentity.model_validate({}).instance_id() is None


# -- detection, against in-process servers answering as each engine does


def _server(routes: dict[str, tuple[int, Any]]) -> web.Application:
    app = web.Application()
    for path, (status, body) in routes.items():

        async def answer(_: web.Request, status: int = status, body: Any = body) -> web.Response:
            return web.json_response(body, status=status)

        app.router.add_get(path, answer)
    return app


OMNI = {"/model_info": (200, {"model_path": "/m", "weight_version": "v", "instance_id": "i-1"})}
SGLANG = {"/model_info": (200, {"model_path": "/m", "weight_version": "default", "served_model_name": "/m"})}
VLLM = {"/version": (200, {"version": "0.32.0"}), "/model_info": (404, {"detail": "Not Found"})}


@pytest.mark.parametrize(("routes", "engine"), [(OMNI, "omni"), (SGLANG, "sglang"), (VLLM, "vllm"), ({}, None)])
async def test_an_engine_is_told_by_its_answers(routes: dict[str, tuple[int, Any]], engine: str | None) -> None:
    client = WorkerClient(stream_limit=4, connect_timeout_s=2.0)
    async with TestServer(_server(routes), host="127.0.0.1") as server:
        name, how = await detect(client, str(server.make_url("")).rstrip("/"), {}, 2.0)
    await client.close()
    assert name == engine
    assert ("register it with an explicit engine" in how) == (engine is None)


# -- which routes each engine serves


def _worker(engine: str | None, port: int = 1, **fields: Any) -> Worker:
    worker = WorkerRegistry().add(f"http://127.0.0.1:{port}", engine=engine)  # type: ignore[arg-type]
    for name, value in fields.items():
        setattr(worker, name, value)
    return worker


def test_a_call_some_target_cannot_serve_is_refused_naming_them() -> None:
    omni, vllm, sglang, unknown = _worker("omni", 1), _worker("vllm", 2), _worker("sglang", 3), _worker(None, 4)
    refuse_unserved([omni, sglang, unknown], ep.UPDATE_WEIGHTS_FROM_DISK.path)  # served (unknown: not judged)
    refuse_unserved([omni, vllm], ep.PAUSE.path)  # omni-worker speaks vLLM's dialect too
    with pytest.raises(BadRequest) as refused:
        refuse_unserved([omni, vllm, sglang], ep.PAUSE_GENERATION.path)
    assert refused.value.extra["unserved"] == [vllm.id]
    assert f"{vllm.id} (vllm)" in refused.value.message and "Nothing was sent" in refused.value.message
    # vLLM serves the two-phase sync only with the project's plugin (found by its probe).
    assert not serves(_worker("vllm", admin_paths=frozenset({ep.PAUSE.path})), ep.PREPARE_WEIGHTS_UPDATE.path)
    assert not serves(vllm, ep.PREPARE_WEIGHTS_UPDATE.path) and serves(omni, ep.PREPARE_WEIGHTS_UPDATE.path)
    assert serves(vllm, ep.COLLECTIVE_RPC.path) and not serves(omni, ep.COLLECTIVE_RPC.path)


def test_areals_vllm_pause_and_continue_go_to_each_engine_in_its_own_routes() -> None:
    """AReaL's ``/areal_pause_generation`` and ``/areal_continue_generation`` (served by the router in
    ``router/gateway/api/areal.py``) become each engine's own aborting pause and continue; a real AReaL vLLM
    server, found by its probe, gets AReaL's routes as they came."""
    areal = _worker("vllm", 5, admin_paths=VLLM_ADMIN | AREAL_SERVER_ADMIN)
    routes = []
    for worker in (_worker("omni", 1), _worker("vllm", 2), _worker("sglang", 3), areal):
        engine = engine_of(worker)
        assert engine is not None
        pause, resume = engine.generation_control(worker, pause=True), engine.generation_control(worker, pause=False)
        routes.append((pause.endpoint.path, pause.query, pause.request.to_json(), resume.endpoint.path))
    assert routes == [
        ("/pause", "mode=abort&clear_cache=true", b'{"mode":"abort","clear_cache":true}', "/resume"),
        ("/pause", "mode=abort&clear_cache=true", b'{"mode":"abort","clear_cache":true}', "/resume"),
        ("/pause_generation", "", b'{"mode":"abort"}', "/continue_generation"),
        (AREAL_PAUSE_GENERATION.path, "", b"{}", AREAL_CONTINUE_GENERATION.path),
    ]


def test_a_paused_sglang_worker_is_probed_where_its_scheduler_is_not_needed() -> None:
    """SGLang's /health generates a token through the scheduler, which parks while generation is paused."""
    from router.gateway.engines import ENGINES

    sglang = _worker("sglang")
    assert ENGINES["sglang"].health_path(sglang) == "/health"
    sglang.paused = True
    assert ENGINES["sglang"].health_path(sglang) == ep.MODEL_INFO.path
    assert ENGINES["vllm"].health_path(_worker("vllm", paused=True)) == "/health"  # vLLM answers while paused


def _routable(registry: WorkerRegistry, engine: str, port: int) -> Worker:
    worker = registry.add(f"http://127.0.0.1:{port}", engine=engine)  # type: ignore[arg-type]
    worker.health, worker.weight_state, worker.instance_id = "healthy", "serving", f"i-{port}"
    return worker


def test_generation_goes_only_where_the_route_is_served() -> None:
    registry = WorkerRegistry()
    omni, vllm = _routable(registry, "omni", 1), _routable(registry, "vllm", 2)
    filtered: dict[str, int] = {}
    pick = version_policy.candidates
    assert pick(registry, LATEST_ONLY, (), filtered, "/generate") == [omni]
    assert filtered == {"engine": 1}
    assert pick(registry, LATEST_ONLY, (), {}, "/v1/completions") == [omni, vllm]
    version_policy.refuse_unserved_route(registry, "/generate")  # served by one engine of the fleet: no 404
    registry.remove(omni.id)
    with pytest.raises(NotFound, match=r"/generate is served by none of the fleet's engines \(vllm\)"):
        version_policy.refuse_unserved_route(registry, "/generate")
    registry.add("http://127.0.0.1:3")  # an engine not known yet may serve it: left to the 503
    version_policy.refuse_unserved_route(registry, "/generate")


# -- the checkpoint a fleet version can be read from again, and loading it into a joiner


def test_a_fleet_version_remembers_the_checkpoint_its_weights_came_from() -> None:
    disk = UpdateWeightsFromDiskRequest(model_path="/ckpt/b")
    assert checkpoint_of(ep.UPDATE_WEIGHTS_FROM_DISK.path, disk, None) == "/ckpt/b"
    reload = CollectiveRpcRequest.model_validate({"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/c"}})
    assert checkpoint_of(ep.COLLECTIVE_RPC.path, reload, None) == "/ckpt/c"
    other = CollectiveRpcRequest.model_validate({"method": "update_config", "kwargs": {"x": "1"}})
    assert checkpoint_of(ep.COLLECTIVE_RPC.path, other, None) is None and not other.reads_only
    from router.gateway.fleet.weights import FleetRecord

    record = FleetRecord(history=[FleetVersionEntry(sequence=1, weight_version="v1", source_path="/ckpt/c")])
    relabel = UpdateWeightVersionRequest(new_version="v2")
    assert checkpoint_of(ep.UPDATE_WEIGHT_VERSION.path, relabel, record) == "/ckpt/c"  # same weights, new label
    group = PrepareWeightsUpdateRequest.model_validate(
        {"num_buckets": 1, "group_name": "g", "buckets": [{"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}]}
    )
    assert checkpoint_of(ep.PREPARE_WEIGHTS_UPDATE.path, group, record) is None  # over a group: no file
    assert CollectiveRpcRequest.model_validate({"method": "check_health"}).reads_only
    assert reload.to_json() == b'{"method":"reload_weights","kwargs":{"weights_path":"/ckpt/c"}}'


def test_each_engine_loads_the_fleets_checkpoint_its_own_way() -> None:
    entry = FleetVersionEntry(sequence=3, weight_version="v3", source_path="/ckpt/v3")
    vllm_steps = from_path.steps(_worker("vllm"), entry)
    assert vllm_steps is not None
    assert [s.endpoint.path for s in vllm_steps] == [ep.COLLECTIVE_RPC.path, ep.UPDATE_WEIGHT_VERSION.path]
    assert vllm_steps[0].request.to_json() == b'{"method":"reload_weights","kwargs":{"weights_path":"/ckpt/v3"}}'
    # SGLang's relabel aborts every request unless told not to: the router says so explicitly.
    assert vllm_steps[1].request.to_json() == b'{"new_version":"v3","abort_all_requests":false}'
    for engine in ("sglang", "omni"):
        disk = from_path.steps(_worker(engine), entry)
        assert disk is not None and [s.endpoint.path for s in disk] == [ep.UPDATE_WEIGHTS_FROM_DISK.path]
        assert disk[0].request.to_json() == (
            b'{"model_path":"/ckpt/v3","abort_all_requests":false,"weight_version":"v3"}'
        )
    assert from_path.steps(_worker("vllm"), entry.model_copy(update={"source_path": None})) is None
    # A vLLM without dev mode serves no /collective_rpc: it cannot catch up.
    assert from_path.steps(_worker("vllm", admin_paths=frozenset()), entry) is None


# -- discovery names a pod's engine


class _Meta:
    def __init__(self, labels: dict[str, str] | None, annotations: dict[str, str] | None):
        self.labels, self.annotations = labels, annotations


class _Pod:
    def __init__(self, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None):
        self.metadata = _Meta(labels, annotations)


def test_a_pod_names_its_engine_by_label_or_annotation() -> None:
    assert pod_engine(_Pod({ENGINE_LABEL: "vllm"}, {ENGINE_LABEL: "sglang"})) == "vllm"
    assert pod_engine(_Pod(None, {ENGINE_LABEL: "sglang"})) == "sglang"
    assert pod_engine(_Pod({"app": "worker"})) is None
    fleet = DiscoveredFleet(WorkerRegistry(), None, None, None, default_engine="omni")  # type: ignore[arg-type]
    chosen = [fleet._engine_of(PodWorker("http://127.0.0.1:1", "ns/p", e)) for e in ("vllm", "auto", None, "tgi")]
    assert chosen == ["vllm", None, "omni", "omni"]


# -- a sleep or release that frees the weights without a copy


def test_a_sleep_or_release_that_frees_the_weights_makes_the_worker_load_them_again() -> None:
    vllm, sglang, omni = ENGINES["vllm"], ENGINES["sglang"], ENGINES["omni"]
    assert vllm.discards_weights(ep.SLEEP.path, SleepQuery(level=2))
    assert not vllm.discards_weights(ep.SLEEP.path, SleepQuery(level=1))  # a host copy: the wake restores it
    assert sglang.discards_weights(ep.RELEASE_MEMORY_OCCUPATION.path, MemoryOccupationRequest())
    assert sglang.discards_weights(ep.RELEASE_MEMORY_OCCUPATION.path, MemoryOccupationRequest(tags=["weights"]))
    assert not sglang.discards_weights(ep.RELEASE_MEMORY_OCCUPATION.path, MemoryOccupationRequest(tags=["kv_cache"]))
    # omni-worker reports its own weight state (partial after a release without a copy).
    assert not omni.discards_weights(ep.RELEASE_MEMORY_OCCUPATION.path, MemoryOccupationRequest(keep_weights=False))


async def test_a_worker_whose_weights_were_freed_is_pending_after_its_wake() -> None:
    registry = WorkerRegistry()
    workers = [registry.add(f"http://127.0.0.{i}:8000", engine="vllm") for i in (2, 3)]
    for i, worker in enumerate(workers):
        worker.health, worker.weight_state, worker.weight_version, worker.instance_id = (
            "healthy",
            "serving",
            "v1",
            f"p{i}",
        )
    await registry.fleet.changed([(w.id, w.weights) for w in workers])
    assert all(registry.is_routable(w) for w in workers)
    await registry.fleet.discarded([workers[0].id])  # its /sleep?level=2 succeeded; then /wake_up
    assert not registry.is_routable(workers[0]) and registry.is_routable(workers[1])
    assert "fleet" in registry.fleet.why_unverified(workers[0].id, workers[0].weights)[1]
