"""Megatron-style tensor parallelism of the model: two real gloo ranks against one.

Two ``python -m tests._tp_model_peer`` processes form a size-2 group on
127.0.0.1 and run every scenario once (module fixture); the tests compare their
reports with the same scenario run here on an unsharded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from router.trainer.sender import sent_checksum
from tests._tiers import process_fixture
from tests._tp_model_peer import BAD_CONFIGS, build, run_case
from tests._tp_ranks import run_ranks
from worker.model import ModelConfig, read_checkpoint
from worker.model.tensor_parallel import ShardSpec, TensorParallel, checkpoint_shard_spec, shard_layout
from worker.model.tiny import random_state_dict, tiny_config, write_checkpoint

SIZE = 2
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, 300, 17, 42, 99, 7, 450, 12, 5]]
STEPS = 8
GROUP_TIMEOUT_S = 30  # the peers' bound on group init and every collective
PEER_EXIT_TIMEOUT_S = 90  # a hang guard only: far above what the peers need
ATOL = RTOL = 1e-4


def _biased_gqa_checkpoint(path: Path) -> Path:
    """Llama with attention_bias (q/k/v and o_proj biases) and one kv head: fewer kv heads than ranks."""
    config = tiny_config("llama", num_key_value_heads=1, attention_bias=True)
    sd = random_state_dict(config, seed=7)
    gen = torch.Generator().manual_seed(8)
    for i in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = sd[f"model.layers.{i}.self_attn.{proj}.weight"].shape[0]
            sd[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.randn(rows, generator=gen) * 0.05
    return write_checkpoint(path, config, sd)


@pytest.fixture(scope="module")
def cases(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    extra = _biased_gqa_checkpoint(tmp_path_factory.mktemp("tp") / "llama-kv1-bias")
    return {"llama": str(checkpoints["llama"]), "qwen2": str(checkpoints["qwen2"]), "llama_kv1_bias": str(extra)}


@process_fixture(scope="module")
def ranks(cases: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report, in rank order."""
    cfg = {"timeout_s": GROUP_TIMEOUT_S, "cases": cases, "prompts": PROMPTS, "steps": STEPS}
    tmp = tmp_path_factory.mktemp("tp_reports")
    return run_ranks("tests._tp_model_peer", "tp", SIZE, cfg, tmp, exit_timeout_s=PEER_EXIT_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(cases: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The same scenario on an unsharded model."""
    out = {}
    for name, path in cases.items():
        model = build(path)
        out[name] = {**run_case(model, PROMPTS, STEPS), "checksum": sent_checksum(model.iter_checkpoint_tensors())}
        out[name]["checkpoint_spec"] = {n: (str(d), tuple(s)) for n, (d, s) in model.checkpoint_spec().items()}
    return out


CASES = ["llama", "qwen2", "llama_kv1_bias"]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_unsharded(ranks, reference, case):
    for rank in ranks:
        got = rank["cases"][case]
        for tp_logits, ref_logits in zip(got["full_logits"], reference[case]["full_logits"], strict=True):
            torch.testing.assert_close(tp_logits, ref_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", CASES)
def test_greedy_decode_through_kv_cache_matches_unsharded(ranks, reference, case):
    ref = reference[case]
    for rank in ranks:
        got = rank["cases"][case]
        assert got["tokens"] == ref["tokens"]
        torch.testing.assert_close(got["step_logits"], ref["step_logits"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", CASES)
def test_every_rank_ends_with_the_same_logits(ranks, case):
    first, second = (r["cases"][case] for r in ranks)
    assert torch.equal(first["step_logits"], second["step_logits"])
    for a, b in zip(first["full_logits"], second["full_logits"], strict=True):
        assert torch.equal(a, b)


def test_parameters_and_kv_cache_hold_only_local_heads(ranks):
    llama = ranks[0]["cases"]["llama"]  # 4 q heads, 2 kv heads, head_dim 16, intermediate 128
    assert llama["kv_heads"] == 1
    assert llama["param_shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * 16, 64)
    assert llama["param_shapes"]["model.layers.0.self_attn.o_proj.weight"] == (64, 2 * 16)
    assert llama["param_shapes"]["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 64, 64)
    assert llama["param_shapes"]["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert llama["param_shapes"]["lm_head.weight"] == (512, 64)  # replicated
    qwen = ranks[0]["cases"]["qwen2"]
    assert qwen["param_shapes"]["model.layers.0.self_attn.qkv_proj.bias"] == ((2 + 1 + 1) * 16,)


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_spec_reports_full_shapes(ranks, reference, case):
    for rank in ranks:
        assert rank["cases"][case]["checkpoint_spec"] == reference[case]["checkpoint_spec"]


@pytest.mark.parametrize("case", CASES)
def test_shards_rebuild_the_full_checkpoint_exactly(ranks, reference, cases, case):
    checkpoint = dict(read_checkpoint(cases[case], torch.float32))
    layout = shard_layout(ModelConfig.from_dir(cases[case]), SIZE)
    per_rank = [r["cases"][case]["shards"] for r in ranks]
    assert per_rank[0].keys() == per_rank[1].keys() == reference[case]["checkpoint_spec"].keys()
    rebuilt = {}
    for name in per_rank[0]:
        spec = checkpoint_shard_spec(name, layout)
        assert all(r["cases"][case]["specs"][name] == (spec.dim, spec.size, spec.replicas) for r in ranks)
        rebuilt[name] = spec.full_tensor([shards[name] for shards in per_rank])
        assert torch.equal(rebuilt[name], checkpoint[name]), name
    # The digest a leader computes from gathered shards is the trainer's, over full tensors.
    expected = sent_checksum((name, checkpoint[name]) for name in rebuilt)
    assert sent_checksum(rebuilt.items()) == expected == reference[case]["checksum"]
    assert all(r["cases"][case]["gathered_checksum"] == expected for r in ranks)


def test_kv_heads_fewer_than_ranks_are_replicated(ranks, cases):
    got = [r["cases"]["llama_kv1_bias"]["shards"] for r in ranks]
    checkpoint = dict(read_checkpoint(cases["llama_kv1_bias"], torch.float32))
    for kind in ("weight", "bias"):
        k = f"model.layers.0.self_attn.k_proj.{kind}"
        assert torch.equal(got[0][k], checkpoint[k]) and torch.equal(got[1][k], checkpoint[k])
        q = f"model.layers.0.self_attn.q_proj.{kind}"
        assert torch.equal(torch.cat([got[0][q], got[1][q]]), checkpoint[q])
    assert ranks[0]["cases"]["llama_kv1_bias"]["kv_heads"] == 1


@pytest.mark.parametrize("case", CASES)
def test_wrong_tensors_are_refused_before_anything_changes(ranks, reference, case):
    for rank in ranks:
        got = rank["cases"][case]
        for call in ("validate_weights", "load_weights"):
            assert "k_proj.weight: shape (7, 64) does not match the model's" in got["refusals"][f"wrong_shape/{call}"]
            full_q = reference[case]["checkpoint_spec"]["model.layers.1.self_attn.q_proj.weight"][1]
            assert f"does not match the model's {full_q}" in got["refusals"][f"local_shape/{call}"]
        assert got["unchanged"]


def test_gradients_through_a_sharded_model_are_refused(ranks):
    assert "tensor-parallel" in ranks[0]["cases"]["llama"]["grad_refusal"]


def test_bad_divisibility_is_refused_at_construction(ranks):
    for rank in ranks:
        for label, message in rank["bad_configs"].items():
            assert label in message and "tensor-parallel size 2" in message, (label, message)
    assert set(ranks[0]["bad_configs"]) == set(BAD_CONFIGS)


@pytest.mark.parametrize(
    "overrides, size, message",
    [
        ({"num_key_value_heads": 3, "num_attention_heads": 12}, 4, "num_key_value_heads=3 is fewer than"),
        ({"num_key_value_heads": 2}, 4, None),
        ({"num_key_value_heads": 1}, 8, "num_attention_heads=4"),
    ],
)
def test_shard_layout_rules(overrides, size, message):
    cfg = ModelConfig.from_dict(tiny_config("llama", **overrides))
    if message is None:
        layout = shard_layout(cfg, size)
        assert (layout.heads, layout.kv_heads, layout.kv_replicas, layout.intermediate) == (1, 1, 2, 32)
    else:
        with pytest.raises(ValueError, match=message):
            shard_layout(cfg, size)


def test_tensor_parallel_needs_a_group_beyond_one_rank():
    assert TensorParallel().all_reduce(t := torch.ones(3)) is t
    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallel(0, 2)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TensorParallel(2, 2)


def test_full_tensor_refuses_diverged_copies():
    a = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(ShardSpec(None, 2).full_tensor([a, a.clone()]), a)
    with pytest.raises(ValueError, match="rank 1's copy differs"):
        ShardSpec(None, 2).full_tensor([a, a + 1])
    # kv heads replicated over pairs of ranks: 4 ranks, 2 distinct slices.
    spec = ShardSpec(0, 4, replicas=2)
    parts = [spec.shard(torch.arange(8.0), r) for r in range(4)]
    assert torch.equal(spec.full_tensor(parts), torch.arange(8.0))
