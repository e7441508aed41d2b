"""Per-token weight-version spans (``meta_info.weight_versions``) on a real worker.

A greedy request is paused mid-generation, the weights are replaced by a second checkpoint under
a new ``weight_version``, and generation continues. The tokens on each side of the reported
boundary must be exactly what transformers computes with each checkpoint, step by step as the
worker ran them: after an ``in_place`` or vLLM ``keep`` pause the new weights continue on the KV
the old ones computed; after a ``retract`` pause they recompute prompt and output first. The worker
sleeps after every step (``--step-delay-ms``) so the request is still running when it is paused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from router.trainer import vllm_sender
from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from router.trainer.tensor_handles import build_cpu_handles
from tests._worker_helpers import Worker, result, sse_events
from tests.procs import free_port
from worker.model import read_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = [72, 101, 108, 108, 111, 44, 32]
N_TOKENS = 40


@pytest.fixture(scope="module")
def vw(worker_factory: Callable[..., Worker], checkpoints: dict[str, Path]) -> Worker:
    return worker_factory(checkpoints["llama"], "--step-delay-ms", "20", "--num-threads", "1")


@pytest.fixture(scope="module")
def hf(checkpoints: dict[str, Path]) -> dict[str, Any]:
    """transformers' own Llama, loaded from each checkpoint the worker serves."""
    return {
        key: transformers.AutoModelForCausalLM.from_pretrained(checkpoints[key]).eval()  # float32, as written
        for key in ("llama", "llama_b")
    }


@pytest.fixture(autouse=True)
def _back_to_a(vw: Worker, checkpoints: dict[str, Path]) -> Iterator[None]:
    yield
    vw.post("/continue_generation", {})
    vw.ok(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["llama"]), "weight_version": "default", "abort_all_requests": True},
    )


def reference(models: list[Any], prompt: list[int], *, recompute_at: int | None = None) -> list[int]:
    """Greedy tokens where token ``i`` is sampled by ``models[i]``, one forward step per token over the
    tokens not yet in the KV cache. ``recompute_at``: the cache is dropped before that token, so its
    step recomputes prompt and output (a retraction)."""
    # transformers 5 renamed ``past_key_values`` to ``cache``, in the call and in its output.
    name = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    out: list[int] = []
    past = None
    with torch.no_grad():
        for i, model in enumerate(models):
            if i == recompute_at:
                past = None
            pending = prompt + out if past is None else out[-1:]
            step = model(input_ids=torch.tensor([pending]), use_cache=True, **{name: past})
            past = step[name]
            out.append(int(step.logits[0, -1].argmax()))
    return out


def spans(meta: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]


def boundary(meta: dict[str, Any], old: str, new: str) -> int:
    """The output index where ``new`` took over: two spans, each holding at least one token."""
    (v0, s0, e0), (v1, s1, e1) = spans(meta)
    assert (v0, s0, v1, s1, e1) == (old, 0, new, e0, meta["completion_tokens"]), meta["weight_versions"]
    assert 0 < e0 < e1, meta["weight_versions"]
    assert meta["weight_version"] == new and meta["first_token_weight_version"] == old
    return e0


@pytest.fixture(scope="module")
def sender(vw: Worker) -> Iterator[TrainerWeightSender]:
    """This process as rank 0 of a gloo group joined through vLLM's ``/init_weight_transfer_engine``."""
    s = TrainerWeightSender(master_port=free_port(), world_size=2, group_name="weight_transfer", timeout_s=60)
    init = {
        "init_info": {"master_address": "127.0.0.1", "master_port": s.master_port, "rank_offset": 1, "world_size": 2}
    }
    status, body = alongside(
        lambda: vw.post("/init_weight_transfer_engine", init, timeout=90), s.join, timeout_s=120, what="init"
    )
    assert status == 200, body
    yield s
    s.close()


def tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(read_checkpoint(str(path), torch.float32))


def group_update(vw: Worker, sender: TrainerWeightSender, path: Path, version: str) -> None:
    """vLLM's start → ``/update_weights`` broadcast over the group (packed) → finish."""
    named = tensors(path)
    announce = vllm_sender.update_info(named, packed=True, packed_buffer_size_bytes=64 * 1024)
    group = sender.group
    assert group is not None
    vw.ok("POST", "/start_weight_update")
    status, body = alongside(
        lambda: vw.post("/update_weights", {"update_info": announce}, timeout=90),
        lambda: vllm_sender.send(group, named, packed=True, packed_buffer_size_bytes=64 * 1024, timeout_s=30),
        timeout_s=120,
        what="update",
    )
    assert status == 200, body
    vw.ok("POST", "/finish_weight_update", {"weight_version": version})


def shm_update(vw: Worker, path: Path, version: str) -> None:
    """vLLM's start → ``/update_weights`` from shared-memory tensors → finish, which may run while
    requests are frozen in place."""
    named = tensors(path)
    body, segment = build_cpu_handles(named)
    try:
        vw.ok("POST", "/start_weight_update")
        meta = vllm_sender.update_info(named)
        vw.ok("POST", "/update_weights", {"update_info": {**meta, "tensor_handles": body["tensor_handles"]}})
    finally:
        segment.close()
        segment.unlink()
    vw.ok("POST", "/finish_weight_update", {"weight_version": version})


def generate_body(n: int, stream: bool = False) -> dict[str, Any]:
    sampling = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": PROMPT, "sampling_params": sampling, "stream": stream}


def test_no_update_is_one_span_everywhere(vw: Worker, hf: dict[str, Any]) -> None:
    out = vw.generate(PROMPT, 12)
    meta = out["meta_info"]
    assert out["output_ids"] == reference([hf["llama"]] * 12, PROMPT)
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert meta["weight_version"] == meta["first_token_weight_version"] == "default"

    empty = vw.generate(PROMPT, 0)["meta_info"]
    assert empty["weight_versions"] == [{"version": "default", "start": 0, "end": 0}]
    assert empty["weight_version"] == "default" and empty["first_token_weight_version"] is None

    body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "n": 2, "ignore_eos": True}
    completion = vw.ok("POST", "/v1/completions", body)
    assert completion["weight_version"] == "default" and completion["metadata"] == {"weight_version": "default"}
    for choice in completion["choices"]:
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
        assert choice["first_token_weight_version"] == "default"


def test_in_place_pause_then_tensor_update(vw: Worker, pool: ThreadPoolExecutor, checkpoints, hf) -> None:
    fut = pool.submit(vw.generate, PROMPT, N_TOKENS)
    vw.wait_running(1)
    vw.ok("POST", "/pause_generation", {"mode": "in_place"})
    shm_update(vw, checkpoints["llama_b"], "v-tensor")
    assert not fut.done()
    vw.ok("POST", "/continue_generation", {})
    out = result(fut)
    n = boundary(out["meta_info"], "default", "v-tensor")
    models = [hf["llama"]] * n + [hf["llama_b"]] * (N_TOKENS - n)
    assert out["output_ids"] == reference(models, PROMPT)
    # The boundary is where the tokens diverge from checkpoint a's own continuation.
    assert out["output_ids"][:n] == reference([hf["llama"]] * n, PROMPT)


def test_retract_pause_then_disk_update(vw: Worker, pool: ThreadPoolExecutor, checkpoints, hf) -> None:
    fut = pool.submit(vw.generate, PROMPT, N_TOKENS)
    vw.wait_running(1)
    vw.ok("POST", "/pause_generation", {"mode": "retract"})
    body = {"model_path": str(checkpoints["llama_b"]), "weight_version": "v-disk"}
    assert vw.ok("POST", "/update_weights_from_disk", body)["num_paused_requests"] == 1
    vw.ok("POST", "/continue_generation", {})
    out = result(fut)
    assert out["meta_info"]["total_retractions"] == 1
    n = boundary(out["meta_info"], "default", "v-disk")
    models = [hf["llama"]] * n + [hf["llama_b"]] * (N_TOKENS - n)
    assert out["output_ids"] == reference(models, PROMPT, recompute_at=n)


def test_vllm_keep_pause_then_group_update_streams_consistent_spans(
    vw: Worker, pool: ThreadPoolExecutor, sender: TrainerWeightSender, checkpoints, hf
) -> None:
    fut = pool.submit(sse_events, vw.url + "/generate", generate_body(N_TOKENS, stream=True))
    vw.wait_running(1)
    vw.ok("POST", "/pause?mode=keep")
    group_update(vw, sender, checkpoints["llama_b"], "v-keep")
    vw.ok("POST", "/resume")
    *chunks, done = result(fut)
    assert done == "[DONE]"
    final = chunks[-1]
    n = boundary(final["meta_info"], "default", "v-keep")
    models = [hf["llama"]] * n + [hf["llama_b"]] * (N_TOKENS - n)
    assert final["output_ids"] == reference(models, PROMPT)
    # Every chunk's spans are the final spans cut at its token count.
    for chunk in chunks:
        meta, count = chunk["meta_info"], len(chunk["output_ids"])
        cut = [(v, s, min(e, count)) for v, s, e in spans(final["meta_info"]) if s < count]
        assert spans(meta) == cut and meta["weight_version"] == cut[-1][0], (meta, count)
        assert meta["first_token_weight_version"] == "default"
    assert {spans(c["meta_info"])[-1][0] for c in chunks} == {"default", "v-keep"}
