"""OpenAI-compatible routes through a real router in front of real workers, called with the
official ``openai`` client: the served models, routing (a disabled worker gets nothing, none
routable is a 503), retries before the first byte, streaming passthrough, the API key, pause
and continue, abort on pause and on client disconnect."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests._router_fixtures import ADMIN_KEY, auth, by_url, start_router, start_workers, wait_for, workers
from tests.procs import http_json

MODEL = "tiny-chat"
API_KEY = "router-test-api-key"
MESSAGES = [{"role": "user", "content": "Say something."}]
WORKER_ARGS = ["--admin-api-key", ADMIN_KEY, "--served-model-name", MODEL, "--step-delay-ms", "20"]


@pytest.fixture(scope="module")
def fleet(worker_fleet, chat_checkpoint) -> list[str]:
    return worker_fleet(2, extra_args=WORKER_ARGS, model=chat_checkpoint).urls


@pytest.fixture(scope="module")
def router(fleet, tmp_path_factory):
    proc, url = start_router(
        fleet,
        admin_key=ADMIN_KEY,
        state_dir=tmp_path_factory.mktemp("openai-router"),
        extra_args=["--api-key", API_KEY, "--policy", "round_robin"],
    )
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def worker_state(url: str) -> dict:
    status, body = http_json("GET", url + "/server_info", headers=auth(), timeout=10)
    assert status == 200, body
    return body["internal_states"][0]


def total(urls: list[str], key: str) -> int:
    return sum(worker_state(u)[key] for u in urls)


def test_models_lists_what_the_workers_serve(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_and_chat_through_the_router_equal_the_workers_answers(router, client, fleet):
    direct = openai.OpenAI(base_url=fleet[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    args = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = direct.completions.create(prompt="route me", **args).choices[0].text
    served = set()
    for _ in range(2):
        raw = client.completions.with_raw_response.create(prompt="route me", **args)
        served.add(raw.headers["X-Omni-Worker"])
        resp = raw.parse()
        assert resp.choices[0].text == expected
        assert resp.model_dump()["weight_version"] == "default"
    assert served == {w["id"] for w in workers(router, ADMIN_KEY)}
    chat_expected = direct.chat.completions.create(messages=MESSAGES, **args).choices[0].message.content
    chat = client.chat.completions.create(messages=MESSAGES, **args)
    assert chat.choices[0].message.content == chat_expected
    streamed = client.chat.completions.create(messages=MESSAGES, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat_expected


def test_api_key_and_caller_mistakes(router):
    wrong = openai.OpenAI(base_url=router + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    keyed = openai.OpenAI(base_url=router + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as err:
        keyed.completions.create(model=MODEL, prompt="x", max_tokens=1, n=0)
    assert err.value.body is not None
    status, body = http_json(
        "POST", router + "/v1/chat/completions", {"messages": []}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 400 and body["error"]["message"]


def test_a_disabled_worker_gets_nothing_and_none_routable_is_503(router, client):
    first, second = workers(router, ADMIN_KEY)
    try:
        assert http_json("PUT", f"{router}/workers/{first['id']}", {"disabled": True}, headers=auth())[0] == 200
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            assert raw.headers["X-Omni-Worker"] == second["id"]
        assert http_json("PUT", f"{router}/workers/{second['id']}", {"disabled": True}, headers=auth())[0] == 200
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert err.value.status_code == 503 and "no routable worker" in err.value.message
        with pytest.raises(openai.APIStatusError) as err:
            client.models.list()
        assert err.value.status_code == 503
    finally:
        for w in (first, second):
            http_json("PUT", f"{router}/workers/{w['id']}", {"disabled": False}, headers=auth())


def test_requests_wait_while_paused_and_complete_after_continue(router, client, fleet):
    status, body = http_json("POST", router + "/pause_generation", {"mode": "abort"}, headers=auth())
    assert status == 200, body
    try:
        with ThreadPoolExecutor(2) as pool:
            completion = pool.submit(
                client.completions.create,
                model=MODEL,
                prompt="paused",
                max_tokens=4,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            chat = pool.submit(
                lambda: list(
                    client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
                    )
                )
            )
            wait_for(lambda: total(fleet, "num_waiting_reqs") == 2, 20, what="both requests queued on paused workers")
            assert not completion.done() and not chat.done()
            status, body = http_json("POST", router + "/continue_generation", {}, headers=auth())
            assert status == 200, body
            resp = completion.result(timeout=60)
            chunks = chat.result(timeout=60)
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
    finally:
        http_json("POST", router + "/continue_generation", {}, headers=auth())


def test_pause_with_abort_ends_a_running_request_as_abort(router, client, fleet):
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="long",
            max_tokens=400,
            extra_body={"ignore_eos": True},
        )
        wait_for(lambda: total(fleet, "num_running_reqs") == 1, 20, what="request running")
        try:
            status, body = http_json("POST", router + "/pause_generation", {"mode": "abort"}, headers=auth())
            assert status == 200, body
            resp = fut.result(timeout=60)
        finally:
            http_json("POST", router + "/continue_generation", {}, headers=auth())
    choice = resp.choices[0]
    assert choice.finish_reason == "abort"
    assert 0 < resp.usage.completion_tokens < 400


def test_client_disconnect_aborts_on_the_worker(router, fleet):
    before = total(fleet, "aborted_requests")
    body = json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
    ).encode()
    host, port = router.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        wait_for(lambda: total(fleet, "num_running_reqs") == 1, 20, what="request running")
    wait_for(lambda: total(fleet, "aborted_requests") > before, 15, what="request aborted on the worker")
    wait_for(lambda: total(fleet, "num_running_reqs") == 0, 15, what="nothing running")


def test_a_worker_gone_before_the_first_byte_is_retried_elsewhere(chat_checkpoint, fleet, tmp_path):
    ((gone_proc, gone_url),) = start_workers(chat_checkpoint, 1, extra_args=WORKER_ARGS)
    # Probes run once at start, then not for an hour: the router learns of the loss only from requests.
    proc, url = start_router(
        [gone_url, fleet[0]],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path,
        extra_args=["--policy", "round_robin", "--health-check-interval-s", "3600"],
    )
    try:
        gone_id = by_url(url, ADMIN_KEY)[gone_url]["id"]
        gone_proc.stop()
        caller = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(4):
            raw = caller.completions.with_raw_response.create(model=MODEL, prompt="retry", max_tokens=2)
            assert raw.headers["X-Omni-Worker"] != gone_id
            assert raw.parse().choices[0].finish_reason in ("stop", "length")
        _, metrics = http_json("GET", url + "/metrics", timeout=10)
        retries = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("omni_router_generate_retries_total{")
        ]
        assert sum(retries) >= 1, metrics
    finally:
        proc.stop()
        gone_proc.stop()
