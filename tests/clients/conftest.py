"""The client-compatibility tier: released RL clients, unchanged, against real omni-workers behind
a real omni-router (``make test-clients``; its own virtualenv, see the README's compatibility section).

Every check of an effect is independent of this project: after a sync, the workers' greedy tokens
equal those ``transformers`` computes on the checkpoint the trainer sent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM's get_ip() otherwise asks the kernel for a route to a public address; every group here is on loopback.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from tests._router_fixtures import running_fleet
from tests._weight_sync_fixtures import WORKER_ARGS

PROMPT = [1, 2, 3, 4, 5, 6]
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def fleet(sync_ckpts: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """Two workers serving checkpoint ``a`` behind a router without an admin key (the clients send none)."""
    with running_fleet(Path(sync_ckpts["a"]), 2, worker_args=WORKER_ARGS) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def pickle_fleet(sync_ckpts: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """Two workers on checkpoint ``a`` that admit SGLang's pickled tensors (``--allow-pickled-tensors``)."""
    with running_fleet(Path(sync_ckpts["a"]), 2, worker_args=[*WORKER_ARGS, "--allow-pickled-tensors"]) as fleet:
        yield fleet


def hf_greedy(path: str, prompt: list[int] = PROMPT, tokens: int = GREEDY_TOKENS) -> list[int]:
    """Greedy continuation of ``prompt`` by ``transformers`` on the checkpoint at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]
