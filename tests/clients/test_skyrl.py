"""SkyRL's ``RemoteInferenceClient`` (skyrl 0.4.0) driving the data and control planes through one omni-router URL.

SkyRL's own client runs unchanged, its router URL given as both the data-plane proxy and the one
control-plane server: ``generate`` and ``sample`` post vLLM's ``/inference/v1/generate`` (token ids in,
token ids and logprobs out; greedy tokens equal ``transformers``' on the served checkpoint),
``tokenize`` and ``detokenize`` post vLLM's routes, ``sleep``/``wake_up``/``is_sleeping`` release
and restore the fleet's memory (level 1 restores the weights from their host copy; level 2, SkyRL's
default, drops them, and the weight sync between the two wakes brings them back, as in SkyRL's
colocated loop), ``pause`` in its default ``keep`` mode (``/pause?mode=keep&clear_cache=false``)
freezes a request in flight, ``resume`` lets it finish, and ``reset_prefix_cache`` (a JSON body, as
SkyRL sends it) answers vLLM's ``{"success": ...}``. SkyRL's weight sync goes through vLLM's trainer
engines, which ``test_trl`` and ``test_vllm`` cover; here a reload from disk stands in for it. On
Python 3.11 the harness gives pydantic ``typing_extensions.TypedDict`` (see below), as SkyRL 0.4
needs Python 3.12's.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest

from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import http_json

if sys.version_info < (3, 12):
    # SkyRL 0.4 declares Python 3.12+: its pydantic models use typing.TypedDict, which pydantic takes
    # on 3.12+ only. On 3.11 the harness hands pydantic typing_extensions' TypedDict (the same class
    # 3.12's typing has) before SkyRL is imported; SkyRL's code itself is unchanged.
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[assignment]
remote_client = pytest.importorskip("skyrl.backends.skyrl_train.inference_servers.remote_inference_client")


def _running(url: str) -> int:
    return int(http_json("GET", url + "/server_info")[1]["internal_states"][0]["num_running_reqs"])


def test_pause_keep_resume_and_reset(fleet: tuple[list[str], str]) -> None:
    workers, router = fleet
    client = remote_client.RemoteInferenceClient(proxy_url=router, server_urls=[router], data_parallel_size=1)
    worker = workers[0]
    answers: list[Any] = []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: answers.append(http_json("POST", worker + "/generate", body, timeout=120)))
    thread.start()

    async def drive() -> None:
        try:
            for _ in range(400):  # bounded: 20 s
                if _running(worker):
                    break
                await asyncio.sleep(0.05)
            paused = await client.pause()
            assert paused[router]["status"] == 200 and paused[router]["body"]["status"] == "paused"
            assert http_json("GET", router + "/is_paused")[1]["is_paused"] is True
            assert _running(worker) == 1 and not answers  # frozen, not aborted
            reset = await client.reset_prefix_cache()
            assert reset[router]["status"] == 200 and reset[router]["body"]["success"] is False  # held by it
            resumed = await client.resume()
            assert resumed[router]["body"]["status"] == "resumed"
        finally:
            await client.aclose()

    asyncio.run(drive())
    thread.join(120)
    assert answers and answers[0][0] == 200
    assert answers[0][1]["meta_info"]["finish_reason"]["type"] == "length"  # resumed to the end
    assert http_json("GET", router + "/is_paused")[1]["is_paused"] is False


def _client(router: str) -> Any:
    return remote_client.RemoteInferenceClient(
        proxy_url=router, server_urls=[router], data_parallel_size=1, model_name="tiny"
    )


GREEDY = {"temperature": 0.0, "max_tokens": GREEDY_TOKENS, "min_tokens": GREEDY_TOKENS, "logprobs": 0}


async def _greedy(client: Any) -> Any:
    return await client.generate({"prompt_token_ids": [PROMPT, PROMPT[:3]], "sampling_params": GREEDY})


def test_generate_sample_tokenize_detokenize(fleet: tuple[list[str], str], sync_ckpts: dict[str, str]) -> None:
    workers, router = fleet
    expected = [hf_greedy(sync_ckpts["a"]), hf_greedy(sync_ckpts["a"], PROMPT[:3])]
    client = _client(router)

    async def drive() -> None:
        try:
            out = await _greedy(client)  # /inference/v1/generate per prompt, then /detokenize per answer
            assert out["response_ids"] == expected
            assert out["stop_reasons"] == ["length", "length"]
            logprobs = out["response_logprobs"]
            assert [len(lp) for lp in logprobs] == [GREEDY_TOKENS] * 2 and all(v <= 0.0 for v in logprobs[0])
            texts = [http_json("POST", workers[0] + "/detokenize", {"tokens": ids})[1]["prompt"] for ids in expected]
            assert out["responses"] == texts

            # Tinker's sample(): n samples of one prompt in one /inference/v1/generate call.
            sampled = await client.sample(
                {
                    "json": {
                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                        "num_samples": 2,
                        "sampling_params": {"temperature": 0.0, "max_tokens": GREEDY_TOKENS, "seed": 5},
                    }
                }
            )
            assert sampled["type"] == "sample" and len(sampled["sequences"]) == 2
            for seq in sampled["sequences"]:
                assert seq["tokens"] == expected[0] and seq["stop_reason"] == "length"
                assert seq["logprobs"] == pytest.approx(logprobs[0], abs=1e-5)

            ids = await client.tokenize(["hello", "hi"], add_special_tokens=True)
            assert ids == [list(b"hello"), list(b"hi")]  # the tiny checkpoints' byte tokenizer
            assert await client.detokenize(ids) == ["hello", "hi"]
        finally:
            await client.aclose()

    asyncio.run(drive())


def test_sleep_and_wake_up(fleet: tuple[list[str], str], sync_ckpts: dict[str, str]) -> None:
    workers, router = fleet
    expected = [hf_greedy(sync_ckpts["a"]), hf_greedy(sync_ckpts["a"], PROMPT[:3])]
    client = _client(router)

    async def drive() -> None:
        try:
            assert await client.is_sleeping() is False
            # Level 1: the weights keep a host copy; the wake brings back the same tokens.
            slept = await client.sleep(level=1)
            assert slept[router]["status"] == 200 and slept[router]["body"]["released"] == ["weights", "kv_cache"]
            assert await client.is_sleeping() is True
            assert all(http_json("GET", w + "/health")[1]["weight_state"] == "released" for w in workers)
            await client.wake_up()
            assert await client.is_sleeping() is False
            await _wait_routable(router)
            assert (await _greedy(client))["response_ids"] == expected

            # Level 2 (SkyRL's default) drops the weights: wake them, sync, then wake the KV cache.
            await client.sleep()
            await client.wake_up(tags=["weights"])
            assert await client.is_sleeping() is True  # the KV cache still sleeps, generation is held
            assert all(http_json("GET", w + "/health")[1]["weight_state"] == "partial" for w in workers)
            status, body = http_json("POST", router + "/update_weights_from_disk", {"model_path": sync_ckpts["a"]})
            assert status == 200, body
            await client.wake_up(tags=["kv_cache"])
            assert await client.is_sleeping() is False
            await _wait_routable(router)
            assert (await _greedy(client))["response_ids"] == expected
        finally:
            await client.aclose()

    asyncio.run(drive())


async def _wait_routable(router: str) -> None:
    """The router's health probes (every 0.5 s here) see the workers serving again."""
    for _ in range(200):  # bounded: 20 s
        fleet = http_json("GET", router + "/workers")[1]["workers"]
        if all(w["health"] == "healthy" and not w["disabled"] and not w.get("pending") for w in fleet):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"workers not routable: {fleet}")
