"""LoRA adapters on a tensor-parallel model: each rank's slices against the full adapter.

In process: every rank's update, computed from its placed slices, is checked
against the unsharded update (column-parallel outputs are the rank's slice of
it, row-parallel partials sum to it). With processes: two real gloo ranks
(``python -m tests._tp_lora_peer``) serve PEFT adapters in a mixed batch, and
their logits and tokens are compared with the same scenario on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._lora_helpers import ADAPTERS, write_adapter
from tests._tiers import process_fixture
from tests._tp_lora_peer import run_lora_case
from tests._tp_model_peer import build
from tests._tp_ranks import run_ranks
from worker.model import LoadedLora, LoraAdapter, ModelConfig
from worker.model.lora import LoraBatch, Placement, place_adapter
from worker.model.lora.loaded import Projection
from worker.model.tensor_parallel import shard_layout
from worker.model.tiny import tiny_config

# PEFT writes the adapters the ranks serve; imported here, not while a test runs.
pytest.importorskip("transformers")
pytest.importorskip("peft")

SIZE = 2
ARCHS = ("llama", "qwen2")
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 300, 17, 42, 99, 7, 450, 12, 5]]
STEPS = 5
GROUP_TIMEOUT_S = 30
PEER_EXIT_TIMEOUT_S = 90  # a hang guard only
ATOL = RTOL = 1e-4


def _random_adapter(cfg: ModelConfig, rank: int, seed: int) -> LoraAdapter:
    """Every module of every layer, random A and B, built from tensors as a trainer would send them."""
    gen = torch.Generator().manual_seed(seed)
    shapes = Placement(cfg, shard_layout(cfg, 1), 0, torch.float32, torch.device("cpu"))
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for block, modules in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        ):
            for module in modules:
                out_features, in_features = shapes.full_shape(module)
                pre = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen)
                tensors[f"{pre}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear", "bias": "none"}
    return LoraAdapter.from_tensors(config, tensors)


def _update(adapter: LoadedLora, layer: int, projection: Projection, x: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    LoraBatch([(adapter, slice(0, x.shape[0]))]).add(layer, projection, x, out)
    return out


@pytest.mark.parametrize("kv_heads, size", [(2, 2), (1, 2), (2, 4), (4, 4)])
def test_rank_slices_rebuild_the_full_update(kv_heads, size):
    cfg = ModelConfig.from_dict(tiny_config("llama", num_key_value_heads=kv_heads))
    adapter = _random_adapter(cfg, rank=4, seed=kv_heads * 10 + size)
    cpu = torch.device("cpu")

    def place(layout_size: int, rank: int) -> LoadedLora:
        placement = Placement(cfg, shard_layout(cfg, layout_size), rank, torch.float64, cpu)
        return place_adapter(adapter, placement, max_rank=8, name="x", version=1)

    full = place(1, 0)
    ranks = [place(size, r) for r in range(size)]
    layout = shard_layout(cfg, size)
    hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, kv_heads * hd
    gen = torch.Generator().manual_seed(0)
    x_hidden, x_attn, x_inter = (torch.randn(5, n, generator=gen, dtype=torch.float64) for n in (hidden, q, inter))
    scaling = adapter.config.scaling
    for layer in range(cfg.num_hidden_layers):
        full_q, full_k, full_v = _update(full, layer, "qkv_proj", x_hidden, q + 2 * kv).split([q, kv, kv], dim=1)
        pair = adapter.weights[(layer, "k_proj")]
        expected_k = x_hidden @ pair.a.double().T @ pair.b.double().T * scaling
        torch.testing.assert_close(full_k, expected_k)
        full_gate, full_up = _update(full, layer, "gate_up_proj", x_hidden, 2 * inter).chunk(2, dim=1)
        local_q, local_kv, local_inter = layout.heads * hd, layout.kv_heads * hd, layout.intermediate
        for r, placed in enumerate(ranks):
            # Column parallel: the rank's columns of the full update (kv heads shared by kv_replicas ranks).
            got_q, got_k, got_v = _update(placed, layer, "qkv_proj", x_hidden, local_q + 2 * local_kv).split(
                [local_q, local_kv, local_kv], dim=1
            )
            kv_slice = slice((r // layout.kv_replicas) * local_kv, (r // layout.kv_replicas + 1) * local_kv)
            torch.testing.assert_close(got_q, full_q[:, r * local_q : (r + 1) * local_q])
            torch.testing.assert_close(got_k, full_k[:, kv_slice])
            torch.testing.assert_close(got_v, full_v[:, kv_slice])
            got_gate, got_up = _update(placed, layer, "gate_up_proj", x_hidden, 2 * local_inter).chunk(2, dim=1)
            torch.testing.assert_close(got_gate, full_gate[:, r * local_inter : (r + 1) * local_inter])
            torch.testing.assert_close(got_up, full_up[:, r * local_inter : (r + 1) * local_inter])
        # Row parallel: each rank sees its input columns; the partials sum (the all-reduce) to the full update.
        for projection, x, local_in in (("o_proj", x_attn, local_q), ("down_proj", x_inter, local_inter)):
            partials = [
                _update(placed, layer, projection, x[:, r * local_in : (r + 1) * local_in], hidden)
                for r, placed in enumerate(ranks)
            ]
            torch.testing.assert_close(sum(partials), _update(full, layer, projection, x, hidden))


@pytest.fixture(scope="module")
def cases(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp_lora")
    return {
        arch: {
            "checkpoint": str(checkpoints[arch]),
            "adapters": {
                label: str(write_adapter(checkpoints[arch], label, root / f"{arch}-{label}")[0]) for label in ADAPTERS
            },
        }
        for arch in ARCHS
    }


@process_fixture(scope="module")
def ranks(cases: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report, in rank order."""
    cfg = {"timeout_s": GROUP_TIMEOUT_S, "cases": cases, "prompts": PROMPTS, "steps": STEPS}
    tmp = tmp_path_factory.mktemp("tp_lora_reports")
    return run_ranks("tests._tp_lora_peer", "tp-lora", SIZE, cfg, tmp, exit_timeout_s=PEER_EXIT_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The same scenario on an unsharded model."""
    return {
        arch: run_lora_case(build(case["checkpoint"]), case["adapters"], PROMPTS, STEPS) for arch, case in cases.items()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_logits_match_unsharded(ranks, reference, arch):
    for rank in ranks:
        got = rank["cases"][arch]["full_logits"]
        assert got.keys() == reference[arch]["full_logits"].keys() == ADAPTERS.keys()
        for label, logits in got.items():
            for tp_logits, ref_logits in zip(logits, reference[arch]["full_logits"][label], strict=True):
                torch.testing.assert_close(tp_logits, ref_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_decode_matches_unsharded(ranks, reference, arch):
    ref = reference[arch]
    for rank in ranks:
        got = rank["cases"][arch]
        assert got["tokens"] == ref["tokens"]
        torch.testing.assert_close(got["step_logits"], ref["step_logits"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_rank_ends_with_the_same_logits(ranks, arch):
    first, second = (r["cases"][arch] for r in ranks)
    assert torch.equal(first["step_logits"], second["step_logits"])
