"""The answers a real SGLang 0.5.23 server gives, as the gateway meets them, pinned on the SGLang stand-in.

The stand-in (:mod:`tests.engines.sglang_standin`) runs SGLang's own server, routes, auth middleware and
tokenizer manager with a stand-in scheduler, so these shapes are SGLang's: empty ``/health``, text
``/flush_cache`` with no content type, an empty ``/abort_request``, JSON ``null`` from the memory routes, a
``/health`` that parks while generation is paused and then answers 503 (leaving ``/ready`` at 503 until a
later ``/health`` succeeds), ``/generate`` parked while paused, the weight version in ``/model_info`` and in
``meta_info``, and the admin key on ``ADMIN_OPTIONAL`` routes.

Engine tier: runs only with ``OMNI_ENGINE_TIER=1`` in an environment where SGLang is installed.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.engines._checkpoints import write_checkpoint
from tests.engines._sglang_standin import SglangStandin, sglang_standin

pytestmark = [
    pytest.mark.skipif(os.environ.get("OMNI_ENGINE_TIER") != "1", reason="engine tier: set OMNI_ENGINE_TIER=1"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here"),
    pytest.mark.timeout(600),
]

ADMIN_KEY = "standin-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: SGLang's own ``SGLANG_HEALTH_CHECK_TIMEOUT`` (whole seconds; 20 by default), small so a parked probe is short.
HEALTH_TIMEOUT_S = 2
TP_SIZE = 2
CALL_TIMEOUT_S = 30.0
#: The stand-in's decode step: a long request (below) runs for about 10 s, so it is still running when a test
#: pauses or aborts it.
STEP_MS = 20
#: As many tokens as the checkpoint's 512-token context leaves after the prompt (SGLang refuses more).
LONG_TOKENS = 500
PROMPT = [256, 72, 101, 108, 108, 111]


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str | None
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    server: SglangStandin,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = CALL_TIMEOUT_S,
) -> Answer:
    """One HTTP call, answered as it came: status, content type and raw body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(resp.status, resp.headers.get("content-type"), resp.read())
    except urllib.error.HTTPError as err:
        return Answer(err.code, err.headers.get("content-type"), err.read())


def generate_body(tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0}, **extra}


class StreamingGenerate:
    """A streamed ``/generate`` that is known to be running: opened once its first chunk has arrived."""

    def __init__(self, server: SglangStandin, tokens: int = LONG_TOKENS, rid: str | None = None):
        host, port = server.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
        body = generate_body(tokens, stream=True, **({"rid": rid} if rid else {}))
        self.conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.first = self._next_event()
        assert self.first is not None and "meta_info" in self.first, self.first
        assert self.first["meta_info"]["finish_reason"] is None

    def _next_event(self) -> dict[str, Any] | None:
        while True:
            line = self.resp.readline()
            if not line:
                raise AssertionError("the stream ended without [DONE]")
            if line.startswith(b"data: "):
                payload = line[len(b"data: ") :].strip()
                return None if payload == b"[DONE]" else json.loads(payload)

    def last(self) -> dict[str, Any]:
        """Read to ``[DONE]``; the last chunk (the finished request)."""
        last = self.first
        while (event := self._next_event()) is not None:
            last = event
        self.conn.close()
        assert last is not None
        return last


@pytest.fixture(scope="module")
def standin_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-standin-ckpts")
    return {"a": write_checkpoint(root / "a", seed=0), "b": write_checkpoint(root / "b", seed=1)}


@pytest.fixture(scope="module")
def server(standin_ckpts: dict[str, Path]) -> Iterator[SglangStandin]:
    args = ["--admin-api-key", ADMIN_KEY, "--weight-version", "v0", "--tp-size", str(TP_SIZE)]
    args += ["--standin-step-ms", str(STEP_MS)]
    with sglang_standin(
        standin_ckpts["a"], extra_args=args, env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S)}
    ) as srv:
        yield srv


def pause(server: SglangStandin, mode: str) -> None:
    answer = call(server, "POST", "/pause_generation", {"mode": mode}, headers=ADMIN)
    assert (answer.status, answer.json()) == (200, {"message": "Generation paused successfully.", "status": "ok"})


def resume(server: SglangStandin) -> None:
    answer = call(server, "POST", "/continue_generation", {}, headers=ADMIN)
    assert (answer.status, answer.json()) == (200, {"message": "Generation continued successfully.", "status": "ok"})


def model_info(server: SglangStandin) -> dict[str, Any]:
    answer = call(server, "GET", "/model_info")
    assert answer.status == 200, answer
    info: dict[str, Any] = answer.json()
    return info


def checkpoint_digests(path: Path) -> dict[str, str]:
    """Recomputed here: SGLang's CPU tensor hash, the first 8 bytes of the sha256 of the tensor's bytes."""
    import torch
    from safetensors import safe_open

    digests = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor: torch.Tensor = handle.get_tensor(name).contiguous()
                digests[name] = hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return digests


def test_health_and_ready_are_empty_and_open_without_the_admin_key(server: SglangStandin) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        answer = call(server, "GET", path)
        assert (answer.status, answer.content_type, answer.body) == (200, None, b""), path


def test_admin_routes_need_the_admin_key(server: SglangStandin) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = call(server, "POST", "/flush_cache", headers=headers)
        assert (answer.status, answer.json()) == (401, {"error": "Unauthorized"})
    # Generation is a normal route: open when no --api-key is set, whatever the admin key.
    assert call(server, "POST", "/generate", generate_body(2)).status == 200


def test_flush_cache_answers_text_without_a_content_type(server: SglangStandin) -> None:
    answer = call(server, "POST", "/flush_cache", headers=ADMIN)
    assert answer.status == 200
    assert answer.content_type is None
    assert answer.body.decode() == (
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


def test_flush_cache_is_refused_while_a_request_runs_in_place(server: SglangStandin) -> None:
    stream = StreamingGenerate(server, rid="standin-in-place-1")
    pause(server, "in_place")
    try:
        answer = call(server, "POST", "/flush_cache", headers=ADMIN)
        assert (answer.status, answer.content_type, answer.body) == (400, None, b"Flush cache failed.\n")
    finally:
        resume(server)
    assert call(server, "POST", "/abort_request", {"rid": "standin-in-place-1"}, headers=ADMIN).status == 200
    assert stream.last()["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_request_answers_an_empty_200_and_ends_the_request(server: SglangStandin) -> None:
    stream = StreamingGenerate(server, rid="standin-abort-1")
    answer = call(server, "POST", "/abort_request", {"rid": "standin-abort-1"}, headers=ADMIN)
    assert (answer.status, answer.content_type, answer.body) == (200, None, b"")
    finish = stream.last()["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    # An unknown rid is no error either.
    assert call(server, "POST", "/abort_request", {"rid": "no-such-request"}, headers=ADMIN).body == b""


def test_memory_routes_answer_json_null(server: SglangStandin) -> None:
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        answer = call(server, "POST", path, {}, headers=ADMIN)
        assert (answer.status, answer.content_type, answer.body) == (200, "application/json", b"null"), path


def test_paused_health_parks_then_503_and_ready_stays_503_until_a_health_succeeds(server: SglangStandin) -> None:
    pause(server, "abort")
    try:
        assert call(server, "GET", "/ready").status == 503
        began = time.monotonic()
        answer = call(server, "GET", "/health", timeout=HEALTH_TIMEOUT_S + 10)
        parked = time.monotonic() - began
        assert (answer.status, answer.body) == (503, b"")
        assert HEALTH_TIMEOUT_S - 0.5 <= parked <= HEALTH_TIMEOUT_S + 3, parked
    finally:
        resume(server)
    # The failed probe marked the server UnHealthy: /ready stays 503 after the pause ends ...
    assert call(server, "GET", "/ready").status == 503
    # ... until a /health succeeds (it takes SGLang's one-second poll at least).
    began = time.monotonic()
    assert call(server, "GET", "/health").status == 200
    assert time.monotonic() - began >= 0.9
    assert call(server, "GET", "/ready").status == 200


def test_generate_waits_while_paused(server: SglangStandin) -> None:
    answers: list[Answer] = []
    pause(server, "retract")
    try:
        waiting = threading.Thread(target=lambda: answers.append(call(server, "POST", "/generate", generate_body(3))))
        waiting.start()
        waiting.join(1.5)
        assert waiting.is_alive(), "a /generate sent while paused must wait, not be answered"
    finally:
        resume(server)
    waiting.join(CALL_TIMEOUT_S)
    assert [a.status for a in answers] == [200]
    assert answers[0].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_a_retracted_request_resumes_and_reports_its_retraction(server: SglangStandin) -> None:
    stream = StreamingGenerate(server, tokens=100)
    pause(server, "retract")
    # While paused, a flush is allowed with retracted requests waiting (SGLang 0.5.23 ignores the waiting queue).
    assert call(server, "POST", "/flush_cache", headers=ADMIN).status == 200
    resume(server)
    meta = stream.last()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 100}
    assert meta["num_retractions"] == 1


def test_update_weights_from_disk_moves_model_info_and_meta_info(
    server: SglangStandin, standin_ckpts: dict[str, Path]
) -> None:
    before = call(server, "POST", "/generate", generate_body(8)).json()
    answer = call(
        server,
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(standin_ckpts["b"]), "weight_version": "v1"},
        headers=ADMIN,
    )
    assert (answer.status, answer.content_type) == (200, "application/json")
    assert answer.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to v1.",
        "num_paused_requests": 0,
    }
    info = model_info(server)
    assert (info["model_path"], info["weight_version"]) == (str(standin_ckpts["b"]), "v1")
    after = call(server, "POST", "/generate", generate_body(8)).json()
    assert after["meta_info"]["weight_version"] == "v1"
    assert after["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 8}]
    assert after["output_ids"] != before["output_ids"]

    missing = call(
        server,
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/nonexistent", "weight_version": "v9"},
        headers=ADMIN,
    )
    assert missing.status == 400
    assert missing.json() == {
        "success": False,
        "message": "Failed to get weights iterator: Cannot find any model weights with `/nonexistent`.",
        "num_paused_requests": 0,
    }
    assert model_info(server)["weight_version"] == "v1"


def test_update_weight_version_aborts_requests_unless_told_not_to(server: SglangStandin) -> None:
    old = model_info(server)["weight_version"]
    stream = StreamingGenerate(server, tokens=100)
    answer = call(
        server, "POST", "/update_weight_version", {"new_version": "vk", "abort_all_requests": False}, headers=ADMIN
    )
    assert answer.json() == {"success": True, "message": "Weight version updated to vk", "new_version": "vk"}
    meta = stream.last()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 100}
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [old, "vk"] and spans[0]["start"] == 0 and spans[-1]["end"] == 100
    assert meta["weight_version"] == "vk"

    # SGLang's default is abort_all_requests=True: a version bump ends what is running.
    stream = StreamingGenerate(server)
    assert call(server, "POST", "/update_weight_version", {"new_version": "vd"}, headers=ADMIN).status == 200
    assert stream.last()["meta_info"]["finish_reason"]["type"] == "abort"
    assert model_info(server)["weight_version"] == "vd"


def test_weights_checker_checksum_is_per_tensor_per_rank(server: SglangStandin, standin_ckpts: dict[str, Path]) -> None:
    info = model_info(server)
    answer = call(server, "POST", "/weights_checker", {"action": "checksum"}, headers=ADMIN)
    assert answer.status == 200
    body = answer.json()
    assert set(body) == {"success", "message", "ranks", "per_engine_checksum"}
    assert (body["success"], body["message"]) == (True, "Success.")
    expected = checkpoint_digests(Path(info["model_path"]))
    per_gpu = hashlib.sha256(b"".join(n.encode() + expected[n].encode() for n in sorted(expected))).hexdigest()
    assert len(body["ranks"]) == TP_SIZE
    for tp_rank, rank in enumerate(body["ranks"]):
        assert rank["checksums"] == expected
        assert rank["per_gpu_checksum"] == per_gpu
        assert rank["parallelism_info"] == [
            {
                "role": "target",
                "tp_rank": tp_rank,
                "tp_size": TP_SIZE,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": tp_rank,
                "size": TP_SIZE,
            }
        ]
    engine = hashlib.sha256(b"".join(r["per_gpu_checksum"].encode() for r in body["ranks"])).hexdigest()
    assert body["per_engine_checksum"] == engine
    other = "a" if info["model_path"] == str(standin_ckpts["b"]) else "b"
    assert checkpoint_digests(standin_ckpts[other]) != expected

    # snapshot / compare answer without ranks; compare without a snapshot fails with SGLang's empty message.
    assert call(server, "POST", "/weights_checker", {"action": "compare"}, headers=ADMIN).json() == {
        "success": False,
        "message": "",
    }
    assert call(server, "POST", "/weights_checker", {"action": "snapshot"}, headers=ADMIN).json() == {
        "success": True,
        "message": "Success.",
    }
    assert call(server, "POST", "/weights_checker", {"action": "compare"}, headers=ADMIN).status == 200


def test_server_info_reports_startup_time_tp_size_and_version(server: SglangStandin) -> None:
    info = call(server, "GET", "/server_info").json()
    assert info["version"] == "0.5.23"
    assert info["tp_size"] == TP_SIZE
    assert info["frontend"] == "python"
    assert set(info["startup_time"]) >= {"load_weight", "scheduler_e2e", "tokenizer_e2e"}
    assert [state["world_size"] for state in info["internal_states"]] == [TP_SIZE]


def test_init_weights_update_group_fails_on_the_standin(server: SglangStandin) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    answer = call(server, "POST", "/init_weights_update_group", body, headers=ADMIN)
    assert answer.status == 400
    assert answer.json()["success"] is False
    assert answer.json()["message"].startswith("Failed to initialize custom process group: ")


def test_validation_errors_are_400_in_sglangs_error_shape(server: SglangStandin) -> None:
    answer = call(server, "POST", "/pause_generation", {"mode": "sideways"}, headers=ADMIN)
    assert answer.status == 400
    assert {k: v for k, v in answer.json().items() if k != "message"} == {
        "object": "error",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


def test_v1_completions_carries_the_weight_version(server: SglangStandin) -> None:
    version = model_info(server)["weight_version"]
    body = {"model": model_info(server)["served_model_name"], "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    answer = call(server, "POST", "/v1/completions", body)
    assert answer.status == 200, answer.body
    completion = answer.json()
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 4
    assert completion["metadata"] == {
        "weight_version": version,
        "weight_versions": [{"version": version, "start": 0, "end": 4}],
    }


def test_logprobs_come_as_sglangs_triples(server: SglangStandin) -> None:
    body = generate_body(4, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    meta = call(server, "POST", "/generate", body).json()["meta_info"]
    output = meta["output_token_logprobs"]
    assert len(output) == 4
    assert all(isinstance(lp, float) and isinstance(token, int) and text is None for lp, token, text in output)
    # Input logprobs cover the whole prompt from logprob_start_len; the first position has none.
    assert [token for _, token, _ in meta["input_token_logprobs"]] == PROMPT
    assert meta["input_token_logprobs"][0][0] is None
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2, 2]
