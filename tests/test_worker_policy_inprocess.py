"""The worker's update policy, in-process: one real coordinator, a fresh app per test, no subprocess.

One coordinator (a tiny llama on CPU, built by ``build_coordinator`` and its scheduler thread started
once for the module) serves every test through an app of its own, ``create_app(config,
coordinator=...)``, driven with pytest-aiohttp's client. The rules checked are those of
``worker/update_pipeline.py`` and ``worker/coordinator.py``:

* an update is refused (400, ``weights: intact``, nothing changed) while requests hold KV computed
  with the current weights: running, or frozen by an ``in_place`` pause; ``abort_all_requests`` ends
  them first and lets it through; a ``retract`` or ``abort`` pause leaves no such request;
* released weights refuse updates, checks and generation (503, at once) until
  ``/resume_memory_occupation``, which brings them back bit for bit;
* ``weight_version`` moves only with an update that succeeded;
* bad bodies and bad checkpoints are 400 with ``{"error": {"message": ...}}`` and change nothing;
* with an admin key configured, every admin route without it answers the same 401 and does nothing.

Admin calls are made one at a time: the coordinator's asyncio locks bind to the loop of the first call
that has to wait on one, and every test runs on a loop of its own. Every test leaves the coordinator as
it found it (restored and checked after each).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient
from safetensors.torch import load_file, save_file

from tests._polling import until
from worker.config import WorkerConfig
from worker.coordinator import Coordinator
from worker.http.app import build_coordinator, create_app
from worker.model import digest_named_tensors, load_model

#: Slow steps keep a long request in flight while a test pauses, updates or releases under it.
STEP_DELAY_S = 0.02
#: Tokens of a request that must still run when the test acts (400 steps: 8 s at the delay above).
LONG = 400
#: Not a speed check: a refusal is answered at once; a request left waiting for weights nobody brings
#: back would never be answered, and this bound ends the test instead.
ANSWERED_WITHIN_S = 20
ADMIN_KEY = "policy-admin-key"

Client = TestClient[web.Request, web.Application]


# -- one coordinator for the module, an app per test ------------------------------------------------


@pytest.fixture(scope="module")
def coordinator(checkpoints: dict[str, Path]) -> Iterator[Coordinator]:
    coord = build_coordinator(WorkerConfig(model_path=str(checkpoints["llama"]), step_delay_s=STEP_DELAY_S))
    coord.stage.start()
    yield coord
    coord.stage.stop()


@pytest.fixture(scope="module")
def sums(checkpoints: dict[str, Path]) -> dict[str, str]:
    """Each checkpoint's own checksum (what ``/weights_checker`` reports once a worker holds it)."""
    return {
        key: digest_named_tensors(load_model(path).iter_checkpoint_tensors())[1] for key, path in checkpoints.items()
    }


def app_for(coord: Coordinator, model: Path, **settings: Any) -> web.Application:
    # The module's coordinator outlives every app: an app given one neither starts nor stops its threads.
    return create_app(WorkerConfig(model_path=str(model), step_delay_s=STEP_DELAY_S, **settings), coordinator=coord)


@pytest.fixture
async def serve(
    aiohttp_client: Callable[..., Awaitable[Client]],
    coordinator: Coordinator,
    checkpoints: dict[str, Path],
    sums: dict[str, str],
) -> AsyncIterator[Callable[..., Awaitable[Client]]]:
    """``await serve(**worker_settings)``: a client of a new app over the module's coordinator."""

    async def start(**settings: Any) -> Client:
        return await aiohttp_client(app_for(coordinator, checkpoints["llama"], **settings))

    yield start
    client = await start()
    await restore(client, checkpoints["llama"], sums["llama"])


@pytest.fixture
async def client(serve: Callable[..., Awaitable[Client]]) -> Client:
    return await serve()


async def restore(client: Client, model: Path, checksum_: str) -> None:
    """End whatever a test left (requests, pause, released memory, other weights), then check the start state."""
    for path, body in (
        ("/abort_request", {"abort_all": True}),
        ("/continue_generation", {}),
        ("/resume_memory_occupation", {}),
    ):
        await ok(client, "POST", path, body)
    info = await ok(client, "GET", "/model_info")
    if info["weights_partial"] or info["model_path"] != str(model) or await checksum(client) != checksum_:
        reload = {"model_path": str(model), "weight_version": "default", "abort_all_requests": True}
        await ok(client, "POST", "/update_weights_from_disk", reload)
    elif info["weight_version"] != "default":
        await ok(client, "POST", "/update_weight_version", {"new_version": "default"})
    await until(lambda: counters(client, "num_running_reqs", "num_waiting_reqs", want=0), 10, "no request left")
    info = await ok(client, "GET", "/model_info")
    assert (info["weight_version"], info["is_paused"], info["weight_state"]) == ("default", False, "serving"), info
    assert await checksum(client) == checksum_


# -- calls --------------------------------------------------------------------------------------------


async def call(
    client: Client,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    async with client.request(
        method, path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def ok(client: Client, method: str, path: str, body: Any = None, **kw: Any) -> Any:
    status, answer = await call(client, method, path, body, **kw)
    assert status == 200, (method, path, status, answer)
    return answer


async def checksum(client: Client) -> str:
    return str((await ok(client, "POST", "/weights_checker", {"action": "checksum"}))["per_gpu_checksum"])


async def version(client: Client) -> str:
    return str((await ok(client, "GET", "/get_weight_version"))["weight_version"])


async def generate(client: Client, prompt: str, tokens: int, **kw: Any) -> tuple[int, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}
    return await call(client, "POST", "/generate", body, **kw)


async def generated(client: Client, prompt: str, tokens: int = 12) -> list[int]:
    status, out = await generate(client, prompt, tokens)
    assert status == 200, out
    return list(out["output_ids"])


async def counters(client: Client, *names: str, want: int) -> bool:
    state = (await ok(client, "GET", "/server_info"))["internal_states"][0]
    return sum(state[name] for name in names) == want


def in_flight(client: Client, prompt: str = "long") -> asyncio.Future[tuple[int, Any]]:
    """A long generation, sent now; await the future for its answer."""
    return asyncio.ensure_future(generate(client, prompt, LONG))


async def running(client: Client, n: int = 1) -> None:
    await until(lambda: counters(client, "num_running_reqs", want=n), 30, f"{n} request(s) running")


def refused_intact(status: int, body: Any, *words: str) -> None:
    """The shape of an update refused before anything was written."""
    assert status == 400, (status, body)
    assert body["success"] is False and body["weights"] == "intact", body
    assert body["error"]["message"] == body["message"], body
    for word in words:
        assert word in body["message"], (word, body["message"])


# -- update refusals while requests hold KV ------------------------------------------------------------


async def test_update_refused_while_active_unless_aborting(
    client: Client, checkpoints: dict[str, Path], sums: dict[str, str]
) -> None:
    """Moved from test_worker_update_disk.py (a real worker process added nothing to it)."""
    long = in_flight(client)
    await running(client)
    status, body = await call(client, "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"])})
    refused_intact(status, body, "active request")
    assert await checksum(client) == sums["llama"] and await version(client) == "default"
    assert await counters(client, "num_running_reqs", want=1)  # still running

    update = {"model_path": str(checkpoints["llama_b"]), "abort_all_requests": True, "weight_version": "w2"}
    body = await ok(client, "POST", "/update_weights_from_disk", update)
    assert body["num_aborted"] == 1
    status, out = await long
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < LONG
    assert out["meta_info"]["weight_version"] == "default"  # answered before the weights changed
    assert await version(client) == "w2" and await checksum(client) == sums["llama_b"]


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_an_update_after_a_pause_is_refused_only_while_paused_requests_hold_kv(
    client: Client, checkpoints: dict[str, Path], sums: dict[str, str], mode: str
) -> None:
    long = in_flight(client)
    await running(client)
    paused = await ok(client, "POST", "/pause_generation", {"mode": mode})
    update = {"model_path": str(checkpoints["llama_b"]), "weight_version": "after-pause"}
    status, body = await call(client, "POST", "/update_weights_from_disk", update)
    if mode == "in_place":
        # Frozen with its KV: refused, nothing changed, the request still there and unanswered.
        refused_intact(status, body, "active request")
        assert await version(client) == "default" and await checksum(client) == sums["llama"]
        assert await counters(client, "num_running_reqs", want=1) and not long.done()
        # abort_all_requests ends it first (with the old version), and the update goes through.
        body = await ok(client, "POST", "/update_weights_from_disk", {**update, "abort_all_requests": True})
        assert body["num_aborted"] == 1
        status, out = await long
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["weight_version"] == "default"
    elif mode == "retract":
        # Retracted: back in the queue without KV, so nothing holds old-weight KV; it waits out the pause.
        assert paused["num_retracted"] == 1
        assert status == 200 and body["num_paused_requests"] == 1, body
        assert await counters(client, "num_waiting_reqs", want=1) and not long.done()
    else:
        # The abort pause answered the request before it returned.
        assert paused["num_aborted"] == 1 and long.done()
        assert status == 200, body
        status, out = await long
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert await version(client) == "after-pause" and await checksum(client) == sums["llama_b"]
    info = await ok(client, "GET", "/model_info")
    assert info["is_paused"] is True and info["pause_mode"] == mode  # the caller's pause is the caller's to end


# -- released memory -------------------------------------------------------------------------------------


async def test_release_and_resume_memory_restore_weights(
    client: Client, checkpoints: dict[str, Path], sums: dict[str, str]
) -> None:
    """Moved from test_worker_admin.py, where it ran on a real worker process."""
    before = await generated(client, "memory")

    long = in_flight(client, "busy")
    await running(client)
    status, body = await call(client, "POST", "/release_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "active request" in body["error"]["message"]
    await ok(client, "POST", "/abort_request", {"abort_all": True})
    assert (await long)[1]["meta_info"]["finish_reason"]["type"] == "abort"

    body = await ok(client, "POST", "/release_memory_occupation", {})
    assert sorted(body["released"]) == ["kv_cache", "weights"]
    assert (await ok(client, "GET", "/model_info"))["weights_released"] is True
    status, body = await call(client, "POST", "/weights_checker", {"action": "checksum"})
    assert status == 400 and "released" in body["message"]
    status, body = await call(client, "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    refused_intact(status, body, "released")
    assert await version(client) == "default"
    assert "memory is released" in (await ok(client, "GET", "/health_generate"))["message"]

    # Released weights cannot serve: a request is refused (503) rather than left waiting.
    async with asyncio.timeout(ANSWERED_WITHIN_S):
        status, body = await generate(client, "memory", 4)
    assert status == 503 and "released" in body["error"]["message"]
    assert (await ok(client, "GET", "/model_info"))["weight_state"] == "released"
    resumed = await ok(client, "POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert sorted(resumed["resumed"]) == ["kv_cache", "weights"]
    assert await checksum(client) == sums["llama"]
    assert await generated(client, "memory") == before
    assert (await ok(client, "GET", "/model_info"))["weights_released"] is False

    status, body = await call(client, "POST", "/release_memory_occupation", {"tags": ["gpu_magic"]})
    assert status == 400 and "tags" in body["error"]["message"]


# -- bad checkpoints and bad bodies -------------------------------------------------------------------


def _variant(tmp_path: Path, src: Path, name: str, mutate: Any = None, config: Any = None) -> Path:
    """A copy of checkpoint ``src`` with its tensors / config changed."""
    out = tmp_path / name
    shutil.copytree(src, out)
    if mutate is not None:
        tensors = load_file(str(out / "model.safetensors"))
        mutate(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _bad_checkpoints(tmp_path: Path, src: Path, qwen: Path) -> dict[str, tuple[Path, str]]:
    def wrong_shape(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)

    def missing(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.3.self_attn.v_proj.weight"]

    def unknown(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.9.mlp.extra.weight"] = torch.zeros(2, 2)

    corrupt = _variant(tmp_path, src, "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    garbage = _variant(tmp_path, src, "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    no_config = _variant(tmp_path, src, "no-config")
    (no_config / "config.json").unlink()
    no_weights = _variant(tmp_path, src, "no-weights")
    (no_weights / "model.safetensors").unlink()
    return {
        "corrupt": (corrupt, ""),
        "garbage": (garbage, ""),
        "wrong shape": (_variant(tmp_path, src, "shape", wrong_shape), "shape"),
        "missing tensor": (_variant(tmp_path, src, "missing", missing), "missing"),
        "unknown tensor": (_variant(tmp_path, src, "unknown", unknown), "unknown"),
        "other hidden size": (_variant(tmp_path, src, "hidden", config={"hidden_size": 32}), "hidden_size"),
        "other architecture": (qwen, "architecture"),
        "no config": (no_config, "config.json"),
        "no safetensors": (no_weights, "safetensors"),
        "not a directory": (tmp_path / "does-not-exist", "not an existing directory"),
    }


async def test_failed_updates_leave_weights_bit_for_bit(
    client: Client, checkpoints: dict[str, Path], sums: dict[str, str], tmp_path: Path
) -> None:
    """Moved from test_worker_update_disk.py: every bad checkpoint is a 400 that changes nothing,
    ``weight_version`` included (it moves only with an update that succeeded)."""
    before = await generated(client, "stable", 16)
    await ok(client, "POST", "/update_weight_version", {"new_version": "v-stable"})
    for label, (path, hint) in _bad_checkpoints(tmp_path, checkpoints["llama_b"], checkpoints["qwen2"]).items():
        update = {"model_path": str(path), "weight_version": "never"}
        status, body = await call(client, "POST", "/update_weights_from_disk", update)
        assert status == 400, (label, body)
        assert body["success"] is False and body["error"]["message"] == body["message"], label
        assert hint.lower() in body["message"].lower(), (label, body["message"])
    update = {"model_path": str(checkpoints["llama_b"]), "load_format": "gguf"}
    status, body = await call(client, "POST", "/update_weights_from_disk", update)
    assert status == 400 and "load_format" in body["message"]

    assert await checksum(client) == sums["llama"]
    assert await generated(client, "stable", 16) == before
    info = await ok(client, "GET", "/model_info")
    assert info["weight_version"] == "v-stable" and info["model_path"] == str(checkpoints["llama"])
    assert not info["weights_partial"] and info["weight_state"] == "serving"


BAD_BODIES: dict[str, list[Any]] = {
    "/generate": [
        {},
        {"text": 5},
        {"text": "a", "input_ids": [1]},
        {"input_ids": [1.5]},
        {"input_ids": [[1], 2]},
        {"text": "a", "stream": "often"},
        {"text": "a", "return_logprob": "sometimes"},
        {"text": ["a", "b"], "rid": "one"},
        {"text": "a", "rid": ["x", "y"]},
        {"text": "a", "sampling_params": {"temperature": "hot"}},
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        {"text": "a", "sampling_params": {"max_new_tokens": 2.5}},
        {"text": "a", "sampling_params": {"max_new_tokens": "many"}},
        {"text": "a", "sampling_params": {"top_k": 0}},
        {"text": "a", "sampling_params": {"top_p": 0}},
        {"text": "a", "sampling_params": {"stop": [""]}},
        {"text": "a", "sampling_params": {"frequency_penalty": 0.5}},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": ""},
    ],
    "/pause_generation": [{"mode": "stop"}, {"mode": 1}],
    "/continue_generation": [{"torch_empty_cache": "nah"}],
    "/abort_request": [{"abort_all": "perhaps"}, {"rid": 5}],
    "/update_weight_version": [{}, {"new_version": 3}, {"new_version": "x", "abort_all_requests": "nope"}],
    "/update_weights_from_disk": [
        {},
        {"model_path": 7},
        {"model_path": ""},
        {"model_path": "<llama>", "abort_all_requests": "sure"},
        {"model_path": "<llama>", "token_step": "three"},
        {"model_path": "<llama>", "flush_cache": 2},
        {"model_path": "<llama>", "manifest": "x"},
    ],
    "/weights_checker": [{"action": "nope"}, {"action": 3}, {"skip_tensor_list": "x"}],
    "/release_memory_occupation": [{"tags": "weights"}, {"tags": ["nope"]}],
    "/resume_memory_occupation": [{"tags": [1]}],
    "/flush_cache": [{"timeout": -1}, {"timeout": "soon"}],
    "/reset_prefix_cache": [{"reset_running_requests": "perhaps"}],
    "/model_info": [],
}


async def test_bad_input_is_400_json_and_changes_nothing(client: Client, checkpoints: dict[str, Path]) -> None:
    """Moved from test_worker_auth_and_input.py: every route's malformed, non-object and invalid
    bodies are 400 with the error shape, and none of them changes the worker."""
    before_info = await ok(client, "GET", "/model_info")
    before_out = await generated(client, "steady", 8)
    before_sum = await checksum(client)
    for path, bodies in BAD_BODIES.items():
        cases: list[tuple[str, Any, bytes | None]] = [
            ("malformed", None, b"{not json"),
            ("not an object", None, b"[1, 2]"),
        ]
        cases += [(repr(b), b, None) for b in bodies]
        for label, body, raw in cases:
            if isinstance(body, dict) and body.get("model_path") == "<llama>":
                body = {**body, "model_path": str(checkpoints["llama"])}
            status, data = await call(client, "POST", path, body, raw=raw)
            assert status == 400, (path, label, status, data)
            assert isinstance(data, dict) and isinstance(data["error"]["message"], str) and data["error"]["message"], (
                path,
                label,
            )
            assert "Traceback" not in str(data)
    status, data = await call(client, "GET", "/flush_cache?timeout=abc")
    assert status == 400 and "timeout" in data["error"]["message"]
    after_info = await ok(client, "GET", "/model_info")
    for key in ("weight_version", "is_paused", "pause_mode", "model_path", "weights_released", "weights_partial"):
        assert after_info[key] == before_info[key], key
    assert await generated(client, "steady", 8) == before_out
    assert await checksum(client) == before_sum
    assert (await ok(client, "GET", "/health"))["status"] == "ok"


# -- the admin key ----------------------------------------------------------------------------------------

#: Admin calls that would each change the worker if they were let through.
CHANGES = [
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/update_weight_version", {"new_version": "stolen"}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "<llama_b>", "weight_version": "stolen"}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("GET", "/model_info", None),
    ("POST", "/weights_checker", {"action": "checksum"}),
]
NOT_THE_KEY: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": ADMIN_KEY},  # no scheme
    {"Authorization": f"Basic {ADMIN_KEY}"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Bearer {ADMIN_KEY}x"},
]


async def test_admin_routes_without_the_key_are_one_401_and_change_nothing(
    serve: Callable[..., Awaitable[Client]], checkpoints: dict[str, Path], sums: dict[str, str]
) -> None:
    keyed = await serve(admin_api_key=ADMIN_KEY)
    plain = await serve()  # the same coordinator, seen through an app without a key
    key = {"Authorization": f"Bearer {ADMIN_KEY}"}
    long = in_flight(keyed)  # generation takes no key here (no api key is configured)
    await running(plain)
    refusals = set()
    for method, path, body in CHANGES:
        if isinstance(body, dict) and body.get("model_path") == "<llama_b>":
            body = {**body, "model_path": str(checkpoints["llama_b"])}
        for headers in NOT_THE_KEY:
            async with keyed.request(
                method, path, data=None if body is None else json.dumps(body).encode(), headers=headers
            ) as resp:
                assert resp.status == 401, (method, path, headers)
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                refusals.add(await resp.text())
    # One answer for every route and every wrong key: it tells nothing about either.
    (refusal,) = refusals
    assert json.loads(refusal)["error"]["message"] == "admin route requires 'Authorization: Bearer <key>'"
    # Nothing was done: the request still runs, on the same weights, version and pause state.
    assert not long.done() and await counters(plain, "num_running_reqs", want=1)
    info = await ok(keyed, "GET", "/model_info", headers=key)
    assert (info["weight_version"], info["is_paused"], info["weight_state"]) == ("default", False, "serving")
    assert (await ok(keyed, "POST", "/weights_checker", {"action": "checksum"}, headers=key))[
        "per_gpu_checksum"
    ] == sums["llama"]
    # The key opens the same routes.
    update = {"model_path": str(checkpoints["llama_b"]), "weight_version": "keyed", "abort_all_requests": True}
    assert (await ok(keyed, "POST", "/update_weights_from_disk", update, headers=key))["num_aborted"] == 1
    assert (await long)[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await ok(keyed, "GET", "/get_weight_version", headers=key))["weight_version"] == "keyed"
