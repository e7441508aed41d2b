"""SkyRL's ``RemoteInferenceClient`` (skyrl 0.4.0) serving a LoRA adapter through one omni-router URL.

SkyRL's LoRA sync (``FSDPPolicyWorker``, and Megatron's, with a ``RemoteInferenceClient``) writes the
adapter in PEFT's format and calls the client's ``load_lora_adapter(name, path)``, which posts
``/skyrl/v1/load_lora_adapter`` to every server: a route of SkyRL's own vLLM server
(``vllm_server_actor.py``) that loads the adapter, or reloads it in place under the same name.
Generation names the adapter in ``model`` on vLLM's ``/inference/v1/generate``; ``unload_lora_adapter``
posts vLLM's ``/v1/unload_lora_adapter`` (then a best-effort ``/collective_rpc`` it ignores the failure
of). The client runs unchanged, its router URL both its data-plane proxy and its one server, with
``uses_lora_weight_sync`` as SkyRL sets it for a LoRA run (generation must name the adapter).

``test_skyrl_generates_with_and_unloads_an_adapter`` loads and reloads the adapter with vLLM's
``/v1/load_lora_adapter`` (``load_inplace`` for the reload: what SkyRL's route does);
``test_skyrl_loads_its_adapter_each_step`` drives SkyRL's own load call, which the router serves
fleet-wide as that route.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.clients import test_trl_lora
from tests.clients.conftest import PROMPT
from tests.clients.test_skyrl import remote_client  # SkyRL's client, with that module's Python 3.11 shim
from tests.clients.test_trl_lora import STEPS, _adapter
from tests.procs import http_json

lora_fleet = test_trl_lora.lora_fleet  # two workers with --enable-lora --max-loras 3 behind a router

NAME = "skyrl-lora"  # SkyRL's SKYRL_LORA_ADAPTER_NAME, its single-tenant adapter
GREEDY = {"temperature": 0.0, "max_tokens": STEPS, "ignore_eos": True}


def _client(router: str) -> Any:
    return remote_client.RemoteInferenceClient(
        proxy_url=router, server_urls=[router], data_parallel_size=1, model_name="tiny", uses_lora_weight_sync=True
    )


async def _tokens(client: Any, model: str) -> list[int]:
    out = await client.generate({"prompt_token_ids": [PROMPT], "sampling_params": GREEDY}, model=model)
    assert out["stop_reasons"] == ["length"]
    tokens: list[int] = out["response_ids"][0]
    return tokens


def _adapters(url: str) -> set[str]:
    status, models = http_json("GET", url + "/v1/models", timeout=10)
    assert status == 200, models
    return {card["id"] for card in models["data"] if card.get("parent")}


def _steps(checkpoint: str, tmp_path: Path) -> list[tuple[str, list[int]]]:
    made = [_adapter(checkpoint, tmp_path / f"step-{step}", seed=30 + step) for step in (1, 2)]
    assert made[0][1] != made[1][1]
    return made


def test_skyrl_generates_with_and_unloads_an_adapter(
    lora_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], tmp_path: Path
) -> None:
    workers, router = lora_fleet
    made = _steps(sync_ckpts["a"], tmp_path)
    client = _client(router)

    async def drive() -> None:
        try:
            for step, (path, expected) in enumerate(made):
                body = {"lora_name": NAME, "lora_path": path, "load_inplace": step > 0}
                status, answer = http_json("POST", router + "/v1/load_lora_adapter", body, timeout=60)
                assert status == 200, answer
                for _ in range(4):  # either worker: the router loaded it on both
                    assert await _tokens(client, NAME) == expected
            assert all(_adapters(url) == {NAME} for url in workers)

            unloaded = await client.unload_lora_adapter(NAME)
            assert unloaded[router]["status"] == 200 and NAME in unloaded[router]["body"], unloaded
            assert all(_adapters(url) == set() for url in workers)
        finally:
            await client.aclose()

    asyncio.run(drive())


def test_skyrl_loads_its_adapter_each_step(
    lora_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], tmp_path: Path
) -> None:
    workers, router = lora_fleet
    made = _steps(sync_ckpts["a"], tmp_path)
    client = _client(router)

    async def drive() -> None:
        try:
            for path, expected in made:  # one name, reloaded in place each step
                loaded = await client.load_lora_adapter(NAME, path)
                assert loaded[router]["status"] == 200, loaded
                answer = json.loads(loaded[router]["body"])
                assert answer["status"] == "ok" and answer["lora_name"] == NAME, answer
                assert (
                    answer["lora_int_id"] == http_json("GET", router + "/fleet/adapters")[1]["adapters"][0]["version"]
                )
                assert await _tokens(client, NAME) == expected
            assert all(_adapters(url) == {NAME} for url in workers)
            await client.unload_lora_adapter(NAME)
        finally:
            await client.aclose()

    asyncio.run(drive())
