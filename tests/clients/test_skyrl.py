"""SkyRL's ``RemoteInferenceClient`` (skyrl 0.4.0) driving the control plane through one omni-router URL.

SkyRL's own client runs unchanged, its router URL given as both the data-plane proxy and the one
control-plane server: ``pause`` in its default ``keep`` mode (``/pause?mode=keep&clear_cache=false``)
freezes a request in flight, ``resume`` lets it finish, and ``reset_prefix_cache`` (a JSON body,
as SkyRL sends it) answers vLLM's ``{"success": ...}``. SkyRL's weight sync goes through vLLM's
trainer engines, which ``test_trl`` and ``test_vllm`` cover; its ``/inference/v1/generate`` data
plane is not served yet. On Python 3.11 the harness gives pydantic ``typing_extensions.TypedDict``
(see below), as SkyRL 0.4 needs Python 3.12's.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest

from tests.clients.conftest import PROMPT
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
