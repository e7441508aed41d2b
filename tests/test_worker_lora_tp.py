"""LoRA adapters served by a tensor-parallel omni-worker (``--tp-size 2 --enable-lora``).

A real worker with its follower rank in a process of its own (gloo on CPU): adapters loaded from a
directory and from tensors, a mixed batch, an update, an unload and refused loads, every generation
checked token for token against transformers + PEFT on the same adapter (a rank serving another
version, or none, would change the tokens). In process: rank 0's side of the pipe against a stand-in
follower, for what a real follower cannot be made to do (refuse a load rank 0 accepted), and for the
adapter ids every forward step carries and drops.
"""

from __future__ import annotations

import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tests.test_worker_lora as worker_lora
from tests._lora_helpers import write_adapter
from tests._tiers import process_fixture
from tests._tp_model_peer import build
from tests._worker_helpers import Worker, forking_pickle
from tests.test_worker_lora import PROMPT, STEPS, _load, _unload_all
from worker.adapters import AdapterService
from worker.engine.results import OpResult
from worker.model.lora import LoraAdapter, LoraAdapters, LoraLoadError
from worker.tp.follower import STOP, Forward, LoadAdapter, RankState
from worker.tp.peers import Follower, TPPeers

#: The PEFT adapters and their reference tokens (``made["plain"] == (path, tokens)``), shared with the TP=1 tests.
made = worker_lora.made
MAX_RANK = 8


@pytest.fixture(scope="module")
def too_large(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed PEFT adapter of rank 16, above the worker's ``--max-lora-rank``."""
    path, _ = write_adapter(checkpoints["llama"], "plain", tmp_path_factory.mktemp("r16") / "r16", r=16, lora_alpha=32)
    return path


@process_fixture(scope="module")
def tp_lora(worker_factory: Any, checkpoints: dict[str, Path]) -> Worker:
    return worker_factory(
        checkpoints["llama"],
        *("--tp-size", "2", "--num-threads", "1", "--enable-lora", "--max-loras", "3"),
        *("--max-lora-rank", str(MAX_RANK), "--allow-pickled-tensors", "--step-delay-ms", "20"),
    )


@pytest.fixture
def tw(tp_lora: Worker) -> Any:
    _unload_all(tp_lora)
    yield tp_lora
    _unload_all(tp_lora)


def _served(worker: Worker, name: str | None, steps: int = STEPS) -> tuple[list[int], int | None]:
    """The greedy tokens of ``PROMPT`` with adapter ``name`` (None: the base), and the version that served them."""
    out = worker.generate(PROMPT, steps, **({} if name is None else {"lora_path": name}))
    return out["output_ids"], out["meta_info"].get("lora_version")


def test_adapters_from_a_path_and_from_tensors_equal_peft_in_a_mixed_batch(tw: Worker, made: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    assert _load(tw, "a", made["plain"][0])["lora_version"] == 1
    assert _served(tw, "a") == (made["plain"][1], 1)
    assert _served(tw, None) == (made["base"], None)
    path = made["attn"][0]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    body = {
        "lora_name": "t",
        "config_dict": json.loads((path / "adapter_config.json").read_text()),
        "serialized_named_tensors": [forking_pickle(tensors)],
    }
    assert tw.ok("POST", "/load_lora_adapter_from_tensors", body)["loaded_adapters"] == {
        "a": str(made["plain"][0]),
        "t": "__tensor__",
    }
    del tensors  # the shared memory the worker opened stays the test's until here
    # One batch mixing the base and both adapters, and the same three as requests arriving together.
    batch = tw.generate([PROMPT] * 3, STEPS, lora_path=[None, "a", "t"], rid=["x", "y", "z"])
    expected = [made["base"], made["plain"][1], made["attn"][1]]
    assert [item["output_ids"] for item in batch] == expected
    with ThreadPoolExecutor(max_workers=6) as pool:
        names = [None, "a", "t"] * 2
        answers = list(pool.map(lambda name: _served(tw, name)[0], names))
    assert answers == expected * 2


def test_an_update_and_an_unload_reach_every_rank_and_spare_requests_in_flight(
    tw: Worker, made: dict[str, Any]
) -> None:
    _load(tw, "u", made["plain"][0])
    long_steps = 30  # 20 ms a step: in flight while the adapter is updated, then unloaded
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(_served, tw, "u", long_steps)
        tw.wait_state(lambda s: s["num_running_reqs"] >= 1, what="the adapter's request running")
        assert _load(tw, "u", made["attn"][0])["lora_version"] == 2
        assert _served(tw, "u") == (made["attn"][1], 2)
        second = pool.submit(_served, tw, "u", long_steps)
        tw.wait_state(lambda s: s["num_running_reqs"] >= 2, what="both versions' requests running")
        assert tw.ok("POST", "/unload_lora_adapter", {"lora_name": "u"})["loaded_adapters"] == {}
        (old, old_version), (new, new_version) = first.result(timeout=60), second.result(timeout=60)
    # Each request kept the version it was admitted with, on both ranks, to its end.
    assert (old[:STEPS], old_version) == (made["plain"][1], 1)
    assert (new[:STEPS], new_version) == (made["attn"][1], 2)
    assert tw.post("/generate", {"input_ids": PROMPT, "lora_path": "u"})[0] == 404
    assert _served(tw, None) == (made["base"], None)


def test_a_refused_load_leaves_the_old_adapter_serving_on_every_rank(
    tw: Worker, made: dict[str, Any], too_large: Path
) -> None:
    _load(tw, "r", made["plain"][0])
    for bad, words in ((too_large, f"max_lora_rank={MAX_RANK}"), (made["bad"], "with r=64")):
        status, answer = tw.post("/load_lora_adapter", {"lora_name": "r", "lora_path": str(bad)})
        assert status == 400 and words in answer["error_message"], answer
        assert answer["loaded_adapters"] == {"r": str(made["plain"][0])}
    assert _served(tw, "r") == (made["plain"][1], 1)
    assert _load(tw, "r", made["attn"][0])["lora_version"] == 2  # the refusals took no version
    assert _served(tw, "r") == (made["attn"][1], 2)
    health = tw.ok("GET", "/model_info")
    assert [r["tp_rank"] for r in health["rank_results"]] == [0, 1] and all(r["alive"] for r in health["rank_results"])


# -- rank 0's side of the pipe, against a stand-in follower ---------------------------------------


class _Process:
    """A follower process that is always alive (the stand-in is a thread)."""

    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, _timeout: float | None = None) -> None:
        pass

    terminate = kill = join


class _StandIn:
    """Rank 1's end of the pipe in a thread: keeps every message, answers forward steps, and accepts or
    refuses adapters as ``refuse`` says."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.messages: list[Any] = []
        self.refuse = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message == STOP:
                return
            self.messages.append(message)
            if isinstance(message, Forward):
                self.conn.send(("ok", None))
            elif isinstance(message, LoadAdapter):
                result = OpResult(False, "out of memory on this rank") if self.refuse else OpResult(True, "")
                self.conn.send(("result", (result, RankState())))

    def close(self) -> None:
        self._thread.join(10)
        assert not self._thread.is_alive()


@pytest.fixture
def rank0(checkpoints: dict[str, Path]) -> Any:
    """Rank 0's model (whole: the stand-in places nothing) and its peers: one stand-in follower."""
    parent, child = Pipe()
    stand_in = _StandIn(child)
    peers = TPPeers([Follower(1, _Process(), parent)])
    yield build(checkpoints["llama"]), peers, stand_in
    peers.close()
    stand_in.close()


def _step(peers: TPPeers, stand_in: _StandIn, batch: list[Any]) -> Forward:
    peers.send_forward(batch)
    peers.await_forward()
    step = stand_in.messages[-1]
    assert isinstance(step, Forward)
    return step


def test_forward_steps_name_adapters_by_the_id_every_rank_holds_and_drop_freed_ones(
    rank0: Any, made: dict[str, Any]
) -> None:
    model, peers, stand_in = rank0
    table = LoraAdapters(model, max_loras=2, max_lora_rank=MAX_RANK)
    adapter = LoraAdapter.from_dir(made["plain"][0])
    placed = table.prepare("a", adapter)
    assert [r.success for r in peers.load_adapter(placed, adapter, max_rank=MAX_RANK)] == [True]
    table.commit(placed)
    sent = stand_in.messages[-1]
    assert isinstance(sent, LoadAdapter) and (sent.adapter_id, sent.name, sent.version) == (1, "a", 1)
    pair = sent.adapter.weights[(0, "q_proj")]
    assert torch.equal(pair.a, adapter.weights[(0, "q_proj")].a)  # the full tensors: the follower slices them
    assert _step(peers, stand_in, [(7, [1, 2], placed), (8, [3], None)]).batch == [(7, [1, 2], 1), (8, [3], None)]

    # A version a follower refused is never served: a step naming it fails before anything is sent.
    stand_in.refuse = True
    refused = table.prepare("a", adapter)
    assert [r.success for r in peers.load_adapter(refused, adapter, max_rank=MAX_RANK)] == [False]
    sent_before = len(stand_in.messages)
    with pytest.raises(RuntimeError, match="never placed on the follower ranks"):
        peers.send_forward([(7, [4], refused)])
    assert len(stand_in.messages) == sent_before
    assert _step(peers, stand_in, [(7, [4], placed)]).dropped_adapters == [2]  # any follower that placed it frees it

    # Unloaded on rank 0 and no request holding it: the followers let it go with the next step.
    table.unload("a")
    del placed
    gc.collect()
    assert _step(peers, stand_in, []).dropped_adapters == [1]


async def test_a_version_a_follower_refuses_is_served_by_no_rank(rank0: Any, made: dict[str, Any]) -> None:
    model, peers, stand_in = rank0
    with ThreadPoolExecutor(max_workers=1) as leader:  # rank 0's scheduler thread
        stage = SimpleNamespace(peers=peers, alive=True, leader=SimpleNamespace(submit_admin=leader.submit))
        service = AdapterService(model, max_loras=2, max_lora_rank=MAX_RANK, allow_pickled=False, stage=stage)  # type: ignore[arg-type]
        first = await service.load_path("a", str(made["plain"][0]))
        stand_in.refuse = True
        with pytest.raises(LoraLoadError, match="refused by tensor-parallel rank 1: out of memory"):
            await service.load_path("a", str(made["attn"][0]))
        assert service.resolve("a") is first and service.version("a") == 1
        assert service.loaded() == {"a": str(made["plain"][0])}
        stand_in.refuse = False
        assert (await service.load_path("a", str(made["attn"][0]))).version == 2
