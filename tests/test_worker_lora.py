"""LoRA adapters served by a real omni-worker, through SGLang's and vLLM's routes.

Adapters are made by PEFT on the tiny checkpoint and saved in its format; every generation with an
adapter is checked token for token against transformers + PEFT on the same adapter.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from router.trainer.digests import expected_adapter_checksum
from tests._lora_helpers import edit_config, hf_model, reference_greedy, write_adapter
from tests._worker_helpers import Worker, forking_pickle

PROMPT = [5, 17, 42, 9, 3]
STEPS = 6


@pytest.fixture(scope="module")
def made(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two PEFT adapters on the llama checkpoint, and the greedy tokens of each (and of the base)."""
    root = tmp_path_factory.mktemp("lora")
    out: dict[str, Any] = {"base": reference_greedy(hf_model(checkpoints["llama"]), PROMPT, STEPS)}
    for label in ("plain", "attn"):
        path, model = write_adapter(checkpoints["llama"], label, root / label)
        out[label] = (path, reference_greedy(model, PROMPT, STEPS))
    bad = shutil.copytree(out["plain"][0], root / "too-large-rank")
    out["bad"] = edit_config(bad, r=64, lora_alpha=64)  # shapes no longer match the config's rank
    return out


@pytest.fixture(scope="module")
def lora_worker(worker_factory: Any, checkpoints: dict[str, Path]) -> Worker:
    return worker_factory(
        checkpoints["llama"], "--enable-lora", "--max-loras", "3", "--allow-pickled-tensors", "--step-delay-ms", "20"
    )


def _tokens(worker: Worker, lora_path: Any = None, **fields: Any) -> dict:
    extra = {} if lora_path is None else {"lora_path": lora_path}
    return worker.generate(PROMPT, STEPS, **extra, **fields)


def _load(worker: Worker, name: str, path: Path) -> dict:
    return worker.ok("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def _unload_all(worker: Worker) -> None:
    for card in worker.ok("GET", "/v1/models")["data"]:
        if card.get("parent"):
            worker.ok("POST", "/unload_lora_adapter", {"lora_name": card["id"]})


@pytest.fixture
def lw(lora_worker: Worker) -> Any:
    _unload_all(lora_worker)
    yield lora_worker
    _unload_all(lora_worker)


def test_generate_with_an_adapter_equals_peft(lw: Worker, made: dict[str, Any]) -> None:
    answer = _load(lw, "a", made["plain"][0])
    saved = load_file(str(Path(made["plain"][0]) / "adapter_model.safetensors"))
    assert answer == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"a": str(made["plain"][0])},
        "lora_version": 1,
        "lora_checksum": expected_adapter_checksum(saved.items()),  # the trainer's digest of what it saved
    }
    with_adapter = _tokens(lw, "a")
    assert with_adapter["output_ids"] == made["plain"][1]
    assert (with_adapter["meta_info"]["lora_name"], with_adapter["meta_info"]["lora_version"]) == ("a", 1)
    base = _tokens(lw)
    assert base["output_ids"] == made["base"] != made["plain"][1]
    assert "lora_name" not in base["meta_info"]
    # A batch mixes the base and two adapters; each prompt gets its own tokens.
    _load(lw, "b", made["attn"][0])
    batch = lw.generate([PROMPT, PROMPT, PROMPT], STEPS, lora_path=[None, "a", "b"], rid=["x", "y", "z"])
    assert [item["output_ids"] for item in batch] == [made["base"], made["plain"][1], made["attn"][1]]


def test_openai_and_token_routes_choose_the_adapter_by_model(lw: Worker, made: dict[str, Any]) -> None:
    _load(lw, "o", made["plain"][0])
    served = lw.info()["served_model_name"] or lw.info()["model_path"]
    for model in ("o", f"{served}:o"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "return_token_ids": True}
        body["ignore_eos"] = True
        answer = lw.ok("POST", "/v1/completions", body)
        assert answer["choices"][0]["token_ids"] == made["plain"][1], model
        assert answer["model"] == "o" and answer["metadata"]["lora_version"] == "1"
    cards = {card["id"]: card for card in lw.ok("GET", "/v1/models")["data"]}
    assert cards["o"]["parent"] == served and cards["o"]["root"] == str(made["plain"][0])
    status, refused = lw.post("/v1/completions", {"model": f"{served}:nope", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and "'nope'" in refused["error"]["message"] and "o" in refused["error"]["message"]
    status, refused = lw.post("/generate", {"input_ids": PROMPT, "lora_path": "nope"})
    assert status == 404 and "loaded: o" in refused["error"]["message"]
    # A name that is neither the served model nor a loaded adapter is vLLM's 404, never the base model's tokens.
    status, refused = lw.post("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and "'nope' does not exist" in refused["error"]["message"], refused
    status, refused = lw.post(
        "/inference/v1/generate", {"model": "nope", "token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    )
    assert status == 404 and "LoRA adapters: o" in refused["error"]["message"], refused


def test_vllm_routes_load_update_in_place_and_unload(lw: Worker, made: dict[str, Any]) -> None:
    # TRL reads lora_config from vLLM's config dump to sync adapters rather than merged weights.
    config = lw.ok("GET", "/server_info?config_format=json")["vllm_config"]
    assert config["lora_config"] == {"max_loras": 3, "max_lora_rank": 64}
    status, text = lw.post("/v1/load_lora_adapter", {"lora_name": "v", "lora_path": str(made["plain"][0])})
    assert (status, text) == (200, "Success: LoRA adapter 'v' added successfully.")
    status, refused = lw.post("/v1/load_lora_adapter", {"lora_name": "v", "lora_path": str(made["attn"][0])})
    assert status == 400 and "load_inplace" in refused["error"]["message"]
    assert _tokens(lw, "v")["output_ids"] == made["plain"][1]  # the refusal changed nothing
    body = {"lora_name": "v", "lora_path": str(made["attn"][0]), "load_inplace": True}
    assert lw.post("/v1/load_lora_adapter", body)[0] == 200
    updated = _tokens(lw, "v")
    assert updated["output_ids"] == made["attn"][1] and updated["meta_info"]["lora_version"] == 2
    status, missing = lw.post("/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and "cannot be found" in missing["error"]["message"]
    assert lw.post("/v1/unload_lora_adapter", {"lora_name": "v"}) == (
        200,
        "Success: LoRA adapter 'v' removed successfully.",
    )


def test_a_failed_update_leaves_the_adapter_serving(lw: Worker, made: dict[str, Any]) -> None:
    _load(lw, "u", made["plain"][0])
    status, answer = lw.post("/load_lora_adapter", {"lora_name": "u", "lora_path": str(made["bad"])})
    assert status == 400 and answer["success"] is False and answer["loaded_adapters"] == {"u": str(made["plain"][0])}
    assert "with r=64" in answer["error_message"]
    served = _tokens(lw, "u")
    assert served["output_ids"] == made["plain"][1] and served["meta_info"]["lora_version"] == 1
    assert _load(lw, "u", made["attn"][0])["lora_version"] == 2
    assert _tokens(lw, "u")["output_ids"] == made["attn"][1]
    # Past --max-loras a load is refused and names what is loaded.
    _load(lw, "b", made["plain"][0])
    _load(lw, "c", made["plain"][0])
    status, full = lw.post("/load_lora_adapter", {"lora_name": "d", "lora_path": str(made["plain"][0])})
    assert (
        status == 400 and "max_loras=3" in full["error_message"] and sorted(full["loaded_adapters"]) == ["b", "c", "u"]
    )


def test_an_unload_lets_the_requests_running_with_it_finish(lw: Worker, made: dict[str, Any]) -> None:
    _load(lw, "w", made["plain"][0])
    steps = 40  # 20 ms a step: the request runs for about a second
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(lw.generate, PROMPT, steps, lora_path="w")
        lw.wait_state(lambda s: s["num_running_reqs"] >= 1, what="the adapter's request running")
        assert lw.ok("POST", "/unload_lora_adapter", {"lora_name": "w"})["loaded_adapters"] == {}
        finished = running.result(timeout=60)
    assert finished["meta_info"]["finish_reason"]["type"] == "length"
    assert finished["output_ids"][:STEPS] == made["plain"][1]  # served by the adapter to its end
    status, _ = lw.post("/generate", {"input_ids": PROMPT, "lora_path": "w"})
    assert status == 404


def test_an_adapter_sent_as_tensors_equals_the_directory(lw: Worker, made: dict[str, Any]) -> None:
    import json

    from safetensors.torch import load_file

    path = made["plain"][0]
    tensors = list(load_file(str(path / "adapter_model.safetensors")).items())
    config = json.loads((path / "adapter_config.json").read_text())
    body = {"lora_name": "t", "config_dict": config, "serialized_named_tensors": [forking_pickle(tensors)]}
    answer = lw.ok("POST", "/load_lora_adapter_from_tensors", body)
    assert answer["loaded_adapters"] == {"t": "__tensor__"} and answer["lora_version"] == 1
    assert _tokens(lw, "t")["output_ids"] == made["plain"][1]
    # SGLang reads an adapter's tensors as a {name: tensor} dict, the form verl sends: the same adapter.
    by_name = {**body, "lora_name": "d", "serialized_named_tensors": [forking_pickle(dict(tensors))]}
    assert lw.ok("POST", "/load_lora_adapter_from_tensors", by_name)["lora_version"] == 1
    assert _tokens(lw, "d")["output_ids"] == made["plain"][1]
    del tensors  # the shared memory the worker opened stays the test's until here


def test_lora_routes_are_refused_when_lora_is_off(worker: Worker, made: dict[str, Any]) -> None:
    status, answer = worker.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(made["plain"][0])})
    assert status == 400 and answer["success"] is False and "--enable-lora" in answer["error_message"]
    status, answer = worker.post("/generate", {"input_ids": PROMPT, "lora_path": "a"})
    assert status == 404 and "not enabled" in answer["error"]["message"]
    assert worker.ok("GET", "/server_info?config_format=json")["vllm_config"].get("lora_config") is None
    # Without an adapter the OpenAI model name is the base, as before.
    assert len(worker.generate(PROMPT, 2)["output_ids"]) == 2
