"""AReaL's remote engines (areal 1.0.4) syncing a LoRA adapter from disk through one omni-router URL.

AReaL's own engines run unchanged, the router's address their one server: ``RemoteSGLangEngine`` and
``RemotevLLMEngine`` (``initialize(addr=...)``, ``pause_generation``, ``update_weights_from_disk``,
``continue_generation``, ``set_version``, ``agenerate``). Their trainer side is what AReaL's FSDP
engine does in ``_update_weights_from_disk``: the adapter saved with PEFT's ``save_pretrained`` and
the model config beside it (its ``_save_model_to_hf`` with ``use_lora``) at the versioned path
``WeightUpdateMeta.with_version`` gives, then the ``name_resolve`` entry AReaL's loader waits for
(``names.update_weights_from_disk`` of the engines' version, here in a file-system record root).

The SGLang engine loads ``<lora_name>-v<version>`` with ``/load_lora_adapter`` and unloads the one
that left its ``lora_keep_versions`` window with ``/unload_lora_adapter``, then generates on
``/generate`` with that name in ``lora_path``; the vLLM engine loads with ``/v1/load_lora_adapter``
(never unloading) and generates on ``/v1/completions`` with the name in ``model`` and
``return_tokens_as_token_ids``. Tokens AReaL parses equal transformers + PEFT's on each version, and
every worker holds the adapters AReaL left loaded.

Both engines' syncs run with their ``pause_generation``/``continue_generation``: SGLang's post
``/pause_generation`` and ``/continue_generation``; the vLLM engine's post ``/areal_pause_generation`` and
``/areal_continue_generation``, routes of AReaL's own vLLM server (``areal/engine/vllm_ext/areal_vllm_server.py``)
that the router serves as the fleet's pause and continue in each worker's own routes. Every worker says it is
paused (``GET /is_paused``, read from the worker itself) between the two, and not paused after.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.clients import test_trl_lora
from tests.clients.conftest import PROMPT
from tests.clients.test_trl_lora import STEPS, _adapter
from tests.procs import http_json

sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
vllm_remote = pytest.importorskip("areal.engine.vllm_remote")
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig  # noqa: E402
from areal.api.io_struct import ModelRequest, WeightUpdateMeta  # noqa: E402
from areal.utils import name_resolve, names  # noqa: E402

lora_fleet = test_trl_lora.lora_fleet  # two workers with --enable-lora --max-loras 3 behind a router

EXPERIMENT, TRIAL = "omni", "lora"
ENGINES = {"sglang": sglang_remote.RemoteSGLangEngine, "vllm": vllm_remote.RemotevLLMEngine}


@pytest.fixture
def name_records(tmp_path: Path) -> None:
    """AReaL's name_resolve in a file-system record root of this test's, as a run on one node configures it."""
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "names")))


def _save_adapter(checkpoint: str, path: Path, seed: int) -> list[int]:
    """What AReaL's FSDP engine writes for a LoRA sync (PEFT's adapter, the model config); its greedy tokens."""
    from transformers import AutoConfig

    _, tokens = _adapter(checkpoint, path, seed)
    AutoConfig.from_pretrained(checkpoint).save_pretrained(str(path))
    return tokens


def _paused(workers: list[str]) -> list[bool]:
    """Whether each worker's generation is paused, as the worker itself says."""
    said = []
    for url in workers:
        status, answer = http_json("GET", url + "/is_paused", timeout=10)
        assert status == 200, answer
        said.append(answer["is_paused"])
    return said


def _sync(engine: Any, meta: WeightUpdateMeta, workers: list[str]) -> None:
    """AReaL's FSDP engine's ``_update_weights_from_disk`` on rank 0, once the adapter is saved, with the
    rollout's pause and continue around it (AReaL's ``pause_generation``/``continue_generation``)."""
    engine.pause_generation()
    assert _paused(workers) == [True] * len(workers)
    future = engine.update_weights_from_disk(meta)
    name_resolve.add(
        names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version()),
        str(datetime.now().timestamp()),
        keepalive_ttl=120,
    )
    future.result(timeout=120)
    assert _paused(workers) == [True] * len(workers)
    engine.continue_generation()
    assert _paused(workers) == [False] * len(workers)


def _adapters(url: str) -> set[str]:
    status, models = http_json("GET", url + "/v1/models", timeout=10)
    assert status == 200, models
    return {card["id"] for card in models["data"] if card.get("parent")}


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_areal_syncs_versioned_adapters_through_the_router(
    backend: str,
    lora_fleet: tuple[list[str], str],
    sync_ckpts: dict[str, str],
    tmp_path: Path,
    name_records: None,
) -> None:
    workers, router = lora_fleet
    lora_name = f"areal-{backend}"
    config = InferenceEngineConfig(
        backend=f"{backend}:d1",
        experiment_name=EXPERIMENT,
        trial_name=TRIAL,
        use_lora=True,
        request_timeout=60,
        setup_timeout=30,
    )
    engine = ENGINES[backend](config)
    engine.initialize(addr=router.removeprefix("http://"))
    base = WeightUpdateMeta.from_disk(
        EXPERIMENT,
        TRIAL,
        str(tmp_path / "fileroot"),
        use_lora=True,
        lora_name=lora_name,
        clear_checkpoint_after_load=False,
        lora_keep_versions=1,
    )
    gconfig = GenerationHyperparameters(greedy=True, max_new_tokens=STEPS, ignore_eos=True, lora_name=lora_name)
    generated: list[tuple[list[int], list[int]]] = []
    try:
        for version in (1, 2):
            meta = base.with_version(version)
            expected = _save_adapter(sync_ckpts["a"], Path(meta.path), seed=20 + version)
            _sync(engine, meta, workers)
            engine.set_version(version)
            response = asyncio.run(engine.agenerate(ModelRequest(input_ids=list(PROMPT), gconfig=gconfig)))
            assert response.stop_reason == "length" and response.output_versions == [version] * STEPS
            assert len(response.output_logprobs) == STEPS and all(lp <= 0.0 for lp in response.output_logprobs)
            generated.append((response.output_tokens, expected))
        held = {url: _adapters(url) for url in workers}
    finally:
        engine.destroy()
        for name in _adapters(workers[0]) & {f"{lora_name}-v1", f"{lora_name}-v2"}:  # the next test's room
            http_json("POST", router + "/unload_lora_adapter", {"lora_name": name}, timeout=60)

    assert generated[0][1] != generated[1][1]
    for tokens, expected in generated:
        assert tokens == expected  # as AReaL parsed them, through the router
    # SGLang's engine unloaded v1 (outside lora_keep_versions=1); vLLM's keeps every version it loaded.
    kept = {f"{lora_name}-v2"} if backend == "sglang" else {f"{lora_name}-v1", f"{lora_name}-v2"}
    assert held == dict.fromkeys(workers, kept)
