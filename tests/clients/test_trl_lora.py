"""TRL's adapter-only sync (async GRPO's ``VLLMClient``, trl 1.16) through one omni-router URL.

TRL's own client code runs unchanged against the router, as it runs against one vLLM server:
``load_lora_adapter`` (``/v1/load_lora_adapter`` with ``load_inplace`` false, a versioned name
``policy-vN`` per step) and ``unload_lora_adapter`` (``/v1/unload_lora_adapter``) of the previous
version, while generation names the adapter in ``model``. The router makes each load fleet-wide:
both workers hold every version, and tokens generated with each equal transformers + PEFT's on the
same adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._router_fixtures import running_fleet
from tests.clients.conftest import PROMPT
from tests.procs import http_json

vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
pytest.importorskip("peft")

STEPS = 6


@pytest.fixture(scope="module")
def lora_fleet(sync_ckpts: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """Two LoRA-serving workers on checkpoint ``a`` behind a router (no admin key: TRL sends none)."""
    with running_fleet(Path(sync_ckpts["a"]), 2, worker_args=["--enable-lora", "--max-loras", "3"]) as fleet:
        yield fleet


def _adapter(checkpoint: str, out: Path, seed: int) -> tuple[str, list[int]]:
    """A PEFT adapter saved by PEFT itself (random, not a no-op), and its greedy tokens by transformers + PEFT."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(str(out))
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return str(out), ids[len(PROMPT) :]


def _tokens(router: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    status, answer = http_json("POST", router + "/v1/completions", {**body, "return_token_ids": True}, timeout=60)
    assert status == 200, answer
    tokens: list[int] = answer["choices"][0]["token_ids"]
    return tokens


def test_trl_syncs_versioned_adapters_through_the_router(
    lora_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], tmp_path: Path
) -> None:
    workers, router = lora_fleet
    client = vllm_client.VLLMClient(router, server_timeout=30)
    made: dict[int, tuple[str, list[int]]] = {}
    for version in (1, 2):
        made[version] = _adapter(sync_ckpts["a"], tmp_path / f"policy-v{version}", seed=version)
        client.load_lora_adapter(f"policy-v{version}", made[version][0])  # TRL raises on anything but 200
        if version > 1:
            client.unload_lora_adapter(f"policy-v{version - 1}")
    assert made[1][1] != made[2][1]
    for _ in range(4):  # either worker: the router loaded it on both
        assert _tokens(router, "policy-v2") == made[2][1]
    for url in workers:
        status, models = http_json("GET", url + "/v1/models", timeout=10)
        assert {card["id"] for card in models["data"] if card.get("parent")} == {"policy-v2"}, models
    base = next(card["id"] for card in models["data"] if not card.get("parent"))
    status, _ = http_json("POST", router + "/v1/completions", {"model": base, "prompt": PROMPT, "max_tokens": 1})
    assert status == 200  # the served model's name is the base model
    # A name that is neither the served model nor a loaded adapter is vLLM's 404, never the base model's tokens
    # (an unloaded adapter's name included: policy-v1).
    for model in ("x", "policy-v1"):
        status, _ = http_json("POST", router + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1})
        assert status == 404, model
    status, gone = http_json("POST", router + "/generate", {"input_ids": PROMPT, "lora_path": "policy-v1"}, timeout=30)
    assert status == 404 and "policy-v1" in gone["error"]["message"]


def test_trl_reads_the_lora_config(lora_fleet: tuple[list[str], str]) -> None:
    _, router = lora_fleet
    info: Any = vllm_client.VLLMClient(router).get_server_info()
    assert info["lora_config"] == {"max_loras": 3, "max_lora_rank": 64}
