"""Admin auth on every route of a real worker, and values coerced as SGLang coerces them.

Bad input on every route (400 JSON, no state change) is checked in-process, test_worker_policy_inprocess.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from router.contract.web.openapi import paths_with_access
from tests.procs import http_json
from worker.http.app import route_table

ADMIN = {"Authorization": "Bearer admin-secret"}
GEN = {"Authorization": "Bearer gen-secret"}
# The routes the worker's table marks open (health probes and the OpenAPI document).
OPEN = set(paths_with_access(route_table(), "open"))
# Generation routes (/generate, OpenAI's /v1/*) take the API key (or the admin key).
GENERATION = set(paths_with_access(route_table(), "generation"))


@pytest.fixture(scope="module")
def kw(worker_factory, checkpoints):
    return worker_factory(
        checkpoints["llama"], "--admin-api-key", "admin-secret", "--api-key", "gen-secret", headers=ADMIN
    )


@pytest.fixture(scope="module")
def served_routes(checkpoints):
    """Every (method, path) the worker app registers, read from its route table
    (so routes other modules add later are covered too)."""
    from worker.config import WorkerConfig
    from worker.http.app import create_app

    app = create_app(WorkerConfig(model_path=str(checkpoints["llama"])))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    return sorted(routes)


def _raw(method, url, headers=None, body=b"{}"):
    req = urllib.request.Request(url, data=None if method == "GET" else body, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers)


def test_every_admin_route_needs_the_admin_key(kw, served_routes):
    admin_routes = [(m, p) for m, p in served_routes if p not in OPEN and p not in GENERATION]
    assert len(admin_routes) >= 20
    for method, path in admin_routes:
        for headers in (None, {"Authorization": "Bearer wrong"}, GEN, {"Authorization": "admin-secret"}):
            status, resp_headers = _raw(method, kw.url + path, headers)
            assert status == 401, (method, path, headers, status)
            assert resp_headers.get("WWW-Authenticate") == "Bearer"
    for path in OPEN:
        assert _raw("GET", kw.url + path)[0] == 200


# Every admin route with a valid call: the admin key opens it (order matters: pause before continue).
VALID_CALLS = [
    ("GET", "/model_info", None, 200),
    ("POST", "/model_info", {}, 200),
    ("GET", "/get_model_info", None, 200),
    ("POST", "/get_model_info", {}, 200),
    ("GET", "/get_weight_version", None, 200),
    ("GET", "/weight_version", None, 200),
    ("POST", "/update_weight_version", {"new_version": "default"}, 200),
    ("GET", "/server_info", None, 200),
    ("GET", "/get_server_info", None, 200),
    ("POST", "/pause_generation", {"mode": "retract"}, 200),
    ("POST", "/continue_generation", {}, 200),
    ("POST", "/abort_request", {"rid": "nothing"}, 200),
    ("GET", "/flush_cache", None, 200),
    ("POST", "/flush_cache", None, 200),
    ("POST", "/reset_prefix_cache", None, 200),
    ("POST", "/update_weights_from_disk", {"model_path": "<llama>"}, 200),
    ("GET", "/weights_checker", None, 200),
    ("POST", "/weights_checker", {"action": "snapshot"}, 200),
    ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, 200),
    ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}, 200),
    ("GET", "/release_memory_occupation", None, 200),
    ("GET", "/resume_memory_occupation", None, 200),
    ("POST", "/update_weights_from_tensor", {}, 400),
    ("GET", "/weights_snapshot", None, 200),
    # Nothing listens on port 1: the load fails at once, weights intact.
    ("POST", "/update_weights_from_peer", {"source_url": "http://127.0.0.1:1"}, 400),
    ("POST", "/begin_weight_update", {"selector": "all"}, 200),
    ("POST", "/end_weight_update", {}, 200),
    ("POST", "/pause", {"mode": "wait"}, 200),
    ("POST", "/resume", {}, 200),
    ("GET", "/is_paused", None, 200),
    ("GET", "/get_world_size", None, 200),
    ("POST", "/start_weight_update", {}, 200),
    ("POST", "/update_weights", {}, 400),
    ("POST", "/finish_weight_update", {}, 200),
    ("POST", "/init_weight_transfer_engine", {}, 400),
    ("POST", "/sleep", {"level": 1, "tags": ["kv_cache"]}, 200),
    ("GET", "/is_sleeping", None, 200),
    ("POST", "/wake_up", {}, 200),
    ("POST", "/abort_requests", {"request_ids": ["nothing"]}, 200),
    # LoRA is off on this worker: the key opens the routes, which then refuse (tests/test_worker_lora.py).
    ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}, 400),
    (
        "POST",
        "/load_lora_adapter_from_tensors",
        {"lora_name": "a", "config_dict": {}, "serialized_named_tensors": ["x"]},
        400,
    ),
    ("POST", "/unload_lora_adapter", {"lora_name": "a"}, 400),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}, 400),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}, 400),
]


def test_admin_key_opens_every_admin_route(kw, checkpoints, served_routes):
    for method, path, body, expected in VALID_CALLS:
        if isinstance(body, dict) and body.get("model_path") == "<llama>":
            body = {"model_path": str(checkpoints["llama"])}
        status, data = kw.call(method, path, body)
        assert status == expected, (method, path, status, data)
    covered = {(m, p) for m, p, _, _ in VALID_CALLS}
    mine = {(m, p) for m, p in served_routes if p not in OPEN and p not in GENERATION}
    # Weight-sync routes need a process group; tests/test_weight_sync_*.py cover them.
    assert not {r for r in mine - covered if not _is_extension(r[1])}


def _is_extension(path):
    return "weights_update" in path or "distributed" in path


def test_generate_needs_the_api_key_and_accepts_the_admin_key(kw):
    body = {"text": "auth", "sampling_params": {"max_new_tokens": 2}}
    assert http_json("POST", kw.url + "/generate", body)[0] == 401
    assert http_json("POST", kw.url + "/generate", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http_json("POST", kw.url + "/generate", body, headers=GEN)[0] == 200
    assert http_json("POST", kw.url + "/generate", body, headers=ADMIN)[0] == 200
    calls = [("/v1/completions", {"prompt": "auth", "max_tokens": 2}), ("/v1/models", None)]
    for path, payload in calls:
        method = "GET" if payload is None else "POST"
        assert http_json(method, kw.url + path, payload)[0] == 401, path
        assert http_json(method, kw.url + path, payload, headers={"Authorization": "Bearer wrong"})[0] == 401, path
        assert http_json(method, kw.url + path, payload, headers=GEN)[0] == 200, path
        assert http_json(method, kw.url + path, payload, headers=ADMIN)[0] == 200, path


def test_admin_key_from_environment(worker_factory, checkpoints):
    ew = worker_factory(checkpoints["llama"], env={"SGLANG_OMNI_ADMIN_KEY": "env-key"})
    assert ew.get("/model_info")[0] == 401
    assert ew.get("/model_info", headers={"Authorization": "Bearer env-key"})[0] == 200
    assert ew.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})[0] == 200
    # The key in force is reported as set, whichever way it was given (and never shown).
    status, info = ew.get("/server_info", headers={"Authorization": "Bearer env-key"})
    assert status == 200 and info["admin_api_key_set"] is True and info["admin_api_key"] is None
    assert "env-key" not in json.dumps(info)


def test_values_coerced_as_sglang_coerces_them(kw, checkpoints):
    """SGLang validates request bodies with pydantic's lax mode, and trainers rely on it (AReaL
    sends ports as strings): numeric strings, integral floats and boolean words are accepted and
    take effect with their normalized values; the bounds still hold."""
    out = kw.ok(
        "POST",
        "/generate",
        {"text": "steady", "return_logprob": "true", "sampling_params": {"max_new_tokens": "3", "temperature": "0"}},
        headers=ADMIN,
    )
    assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
    greedy = kw.generate("steady", 3, headers=ADMIN)["output_ids"]
    assert out["output_ids"] == greedy
    assert kw.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "-1"}}, headers=ADMIN)[0] == 400
    before = kw.info()["weight_version"]
    version = kw.ok(
        "POST", "/update_weight_version", {"new_version": "coerced", "abort_all_requests": "false"}, headers=ADMIN
    )
    assert version["success"] is True and kw.info()["weight_version"] == "coerced"
    kw.ok("POST", "/update_weight_version", {"new_version": before, "abort_all_requests": 0}, headers=ADMIN)
    assert kw.ok("GET", "/flush_cache?timeout=1.5", headers=ADMIN)["success"] is True
    assert kw.info()["weight_version"] == before
