"""SGLang's LoRA routes through a real omni-router, to SGLang servers: SGLang 0.5.23's own HTTP server and tokenizer
manager over a stand-in scheduler (:mod:`tests.engines.sglang_standin`, whose LoRA adapters are a table with
SGLang's refusals; SGLang has no CPU build).

A load through the router (``/load_lora_adapter``, or ``/load_lora_adapter_from_tensors``) reaches both servers
or neither: both list it afterwards (``GET /v1/models``, read from the servers themselves) and a request naming it
is served; a load one server refuses (it already holds that name) is rolled back on the other; a load carrying the
trainer's digest is refused before anything is sent (SGLang reports no digest of what it loaded); an unload
removes it from both. Runs in the engine tier only (``make test-engines``).
"""

from __future__ import annotations

import base64
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.contract.weight_digest import EXPECTED_CHECKSUM_HEADER
from tests.engines._sglang_standin import SglangStandin, ready_standins, start_standin
from tests.engines.conftest import AUTH, Router
from tests.procs import http_json

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here"),
    pytest.mark.timeout(600),
]

WORKER_KEY = "sglang-worker-key"
SERVER_ARGS = ["--admin-api-key", WORKER_KEY, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]
GENERATE = {"input_ids": [256, 72, 101, 108, 108, 111], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
WORKER_AUTH = {"Authorization": f"Bearer {WORKER_KEY}"}


@pytest.fixture(scope="module")
def pair(ckpts: dict[str, Path]) -> Iterator[list[SglangStandin]]:
    """Two SGLang stand-ins on checkpoint A with LoRA enabled."""
    servers = [start_standin(ckpts["a"], extra_args=SERVER_ARGS) for _ in range(2)]
    with ready_standins(servers):
        yield servers


@pytest.fixture
def router(pair: list[SglangStandin], router_for: Any) -> Router:
    made: Router = router_for([s.url for s in pair], "--worker-api-key", WORKER_KEY)
    return made


def _adapter(path: Path, rank: int = 4) -> str:
    """A PEFT adapter directory as SGLang reads one: its ``adapter_config.json`` (the stand-in reads no tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def held(server: SglangStandin) -> dict[str, str]:
    """The adapters the server itself lists: name → path (SGLang's ``/v1/models`` cards with a parent)."""
    status, models = http_json("GET", server.url + "/v1/models", timeout=10)
    assert status == 200, models
    return {card["id"]: card["root"] for card in models["data"] if card.get("parent")}


def test_a_load_reaches_every_server_and_an_unload_leaves_none(
    router: Router, pair: list[SglangStandin], tmp_path: Path
) -> None:
    path = _adapter(tmp_path / "tuned")
    answer = router.ok("POST", "/load_lora_adapter", {"lora_name": "tuned", "lora_path": path})
    assert answer["success"] and answer["loaded_adapters"] == {"tuned": path}, answer
    assert all(r["body"]["loaded_adapters"] == {"tuned": path} for r in answer["results"]), answer
    assert [held(s) for s in pair] == [{"tuned": path}] * 2
    table = router.ok("GET", "/fleet/adapters")
    assert {a["name"] for a in table["adapters"]} == {"tuned"}, table
    for _ in range(2):  # both servers: SGLang's tokenizer manager takes the name it registered
        status, out = http_json("POST", router.url + "/generate", {**GENERATE, "lora_path": "tuned"}, timeout=60)
        assert status == 200, out

    answer = router.ok("POST", "/unload_lora_adapter", {"lora_name": "tuned"})
    assert answer["success"], answer
    assert [held(s) for s in pair] == [{}, {}]
    assert router.ok("GET", "/fleet/adapters")["adapters"] == []


def test_an_adapter_sent_as_tensors_reaches_every_server(router: Router, pair: list[SglangStandin]) -> None:
    # SGLang's payload: one base64 entry per rank (the stand-in records the adapter without reading its tensors).
    payload = base64.b64encode(b"serialized tensors, not read by the stand-in").decode()
    body = {"lora_name": "pushed", "config_dict": {"peft_type": "LORA", "r": 4}, "serialized_named_tensors": [payload]}
    answer = router.ok("POST", "/load_lora_adapter_from_tensors", body)
    assert answer["success"] and answer["loaded_adapters"] == {"pushed": "__tensor__"}, answer
    assert [held(s) for s in pair] == [{"pushed": "__tensor__"}] * 2
    router.ok("POST", "/unload_lora_adapter", {"lora_name": "pushed"})
    assert [held(s) for s in pair] == [{}, {}]


def test_a_load_one_server_refuses_is_rolled_back_on_the_other(
    router: Router, pair: list[SglangStandin], tmp_path: Path
) -> None:
    path = _adapter(tmp_path / "solo")
    # The first server already holds the name (loaded behind the router): SGLang refuses to load it again.
    status, own = http_json(
        "POST", pair[0].url + "/load_lora_adapter", {"lora_name": "solo", "lora_path": path}, headers=WORKER_AUTH
    )
    assert status == 200 and own["success"], own
    try:
        status, answer = router.call("POST", "/load_lora_adapter", {"lora_name": "solo", "lora_path": path})
        assert status >= 400 and not answer["success"], answer
        assert "already loaded" in answer["error"]["message"] and "rolled back on 1 of 1" in answer["error"]["message"]
        refused, took = answer["results"]
        assert (refused["status_code"], took["status_code"]) == (400, 200), answer
        assert [held(s) for s in pair] == [{"solo": path}, {}]  # the second one gave it back
        assert router.ok("GET", "/fleet/adapters")["adapters"] == []
    finally:
        http_json("POST", pair[0].url + "/unload_lora_adapter", {"lora_name": "solo"}, headers=WORKER_AUTH)
    assert [held(s) for s in pair] == [{}, {}]


def test_a_trainers_digest_is_refused_before_anything_is_sent(
    router: Router, pair: list[SglangStandin], tmp_path: Path
) -> None:
    path = _adapter(tmp_path / "checked")
    headers = {**AUTH, EXPECTED_CHECKSUM_HEADER: "0" * 64}
    body = {"lora_name": "checked", "lora_path": path}
    status, answer = http_json("POST", router.url + "/load_lora_adapter", body, headers=headers, timeout=60)
    assert status == 400 and "reports no digest" in answer["error"]["message"], answer
    assert sorted(answer["unserved"]) == sorted(w["id"] for w in router.workers()), answer
    assert [held(s) for s in pair] == [{}, {}]


def test_a_rank_the_servers_cannot_hold_is_refused_everywhere(
    router: Router, pair: list[SglangStandin], tmp_path: Path
) -> None:
    path = _adapter(tmp_path / "wide", rank=64)
    status, answer = router.call("POST", "/load_lora_adapter", {"lora_name": "wide", "lora_path": path})
    assert status == 400 and "max-lora-rank" in answer["error"]["message"], answer
    assert [held(s) for s in pair] == [{}, {}]
