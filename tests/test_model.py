"""The load_weights core against transformers' own Llama / Qwen2 implementations."""

from __future__ import annotations

import json

import pytest
import torch

from worker.model import (
    SeqInput,
    WeightLoadError,
    digest_named_tensors,
    load_model,
    load_tokenizer,
    read_checkpoint,
    write_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

ARCHS = {
    "llama": {"cls": "LlamaForCausalLM", "cfg": "LlamaConfig", "extra": {"tie_word_embeddings": False}},
    "qwen2": {"cls": "Qwen2ForCausalLM", "cfg": "Qwen2Config", "extra": {"tie_word_embeddings": True}},
}


def _hf_model(arch: str, seed: int = 0):
    spec = ARCHS[arch]
    config = getattr(transformers, spec["cfg"])(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        **spec["extra"],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"])(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_checkpoint(request, tmp_path_factory):
    arch = request.param
    model = _hf_model(arch)
    path = tmp_path_factory.mktemp(f"hf_{arch}")
    # A small shard size forces a sharded checkpoint with model.safetensors.index.json.
    model.save_pretrained(path, max_shard_size="100KB")
    return arch, model, path


def test_checkpoint_is_sharded(hf_checkpoint):
    _, _, path = hf_checkpoint
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_logits_match_transformers(hf_checkpoint):
    arch, hf, path = hf_checkpoint
    ours = load_model(path, dtype=torch.float32)
    assert ours.config.architecture == arch
    ids = torch.randint(0, 300, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits.float()
    got = ours.forward_full(ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_cached_ragged_batch_matches_full_forward(hf_checkpoint):
    _, hf, path = hf_checkpoint
    ours = load_model(path)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 300, (1, 12), generator=gen), torch.randint(0, 300, (1, 7), generator=gen)
    with torch.no_grad():
        ref_a, ref_b = hf(a).logits[0], hf(b).logits[0]
    kv_a, kv_b = ours.new_kv_cache(4), ours.new_kv_cache(4)
    # Prefill a's first 10 tokens together with b's first 5, then decode both step by step.
    out = ours.forward_batch([SeqInput(a[0, :10].tolist(), kv_a), SeqInput(b[0, :5].tolist(), kv_b)])
    torch.testing.assert_close(out[0], ref_a[9], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out[1], ref_b[4], atol=2e-4, rtol=2e-4)
    for step in range(2):
        out = ours.forward_batch([SeqInput([a[0, 10 + step].item()], kv_a), SeqInput([b[0, 5 + step].item()], kv_b)])
        torch.testing.assert_close(out[0], ref_a[10 + step], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(out[1], ref_b[5 + step], atol=2e-4, rtol=2e-4)


def test_bfloat16_serving_dtype(hf_checkpoint):
    _, hf, path = hf_checkpoint
    ours = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = torch.arange(16)[None]
    with torch.no_grad():
        expected = hf(ids).logits.float()
    # bf16 rounding: compare the predicted tokens' agreement, not exact values.
    agree = (ours.forward_full(ids).argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.8


@pytest.fixture()
def tiny(tmp_path):
    return load_model(write_tiny_checkpoint(tmp_path / "m", "llama", seed=3))


def _checksum(model) -> str:
    return digest_named_tensors(model.iter_checkpoint_tensors())[1]


@pytest.mark.parametrize(
    "bad, message",
    [
        (("model.layers.0.self_attn.q_proj.wieght", (64, 64), torch.float32), "unknown parameter name"),
        (("model.layers.0.self_attn.k_proj.weight", (64, 64), torch.float32), "shape"),
        (("model.layers.0.mlp.up_proj.weight", (128, 64), torch.float16), "dtype"),
    ],
)
def test_load_weights_rejects_before_modifying(tiny, bad, message):
    before = _checksum(tiny)
    good = ("model.layers.0.mlp.down_proj.weight", torch.ones(64, 128))
    name, shape, dtype = bad
    with pytest.raises(WeightLoadError, match=message):
        tiny.load_weights([good, (name, torch.zeros(shape, dtype=dtype))])
    assert _checksum(tiny) == before


def test_load_weights_maps_onto_fused_shards(tiny):
    k = torch.full((32, 64), 0.5)
    up = torch.full((128, 64), -0.25)
    assert (
        tiny.load_weights([("model.layers.1.self_attn.k_proj.weight", k), ("model.layers.1.mlp.up_proj.weight", up)])
        == 2
    )
    layer = tiny.model.layers[1]
    assert torch.equal(layer.self_attn.qkv_proj.weight[64:96], k)  # q rows 0..63, k rows 64..95
    assert not torch.equal(layer.self_attn.qkv_proj.weight[:64], torch.full((64, 64), 0.5))
    assert torch.equal(layer.mlp.gate_up_proj.weight[128:], up)
    views = dict(tiny.iter_checkpoint_tensors())
    assert torch.equal(views["model.layers.1.self_attn.k_proj.weight"], k)


def test_complete_load_requires_every_tensor(tmp_path, tiny):
    path = write_tiny_checkpoint(tmp_path / "other", "llama", seed=4)
    partial = [(n, t) for n, t in read_checkpoint(path, torch.float32) if "layers.3" not in n]
    before = _checksum(tiny)
    with pytest.raises(WeightLoadError, match="missing"):
        tiny.load_weights(partial, require_complete=True)
    assert _checksum(tiny) == before


def test_tied_checkpoint_accepts_and_skips_lm_head(tmp_path):
    model = load_model(write_tiny_checkpoint(tmp_path / "q", "qwen2", seed=5))
    assert "lm_head.weight" not in model.checkpoint_spec()
    before = _checksum(model)
    assert model.load_weights([("lm_head.weight", torch.zeros(512, 64))]) == 0
    assert _checksum(model) == before


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "c", "llama")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="cannot read"):
        load_model(path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path / "nope")
    with pytest.raises(WeightLoadError, match="not a directory"):
        list(read_checkpoint(tmp_path / "nope", torch.float32))


def test_index_cannot_point_outside_checkpoint(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "i", "llama")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(WeightLoadError, match="outside"):
        list(read_checkpoint(path, torch.float32))


def test_byte_tokenizer_round_trip(tmp_path):
    tok = load_tokenizer(write_tiny_checkpoint(tmp_path / "t", "llama"))
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode())
    assert tok.decode([*ids, 257]) == "héllo"


def test_forward_logits_is_the_serving_math_and_differentiable(tiny):
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    for param in tiny.parameters():
        param.requires_grad_(True)
    logits = tiny.forward_logits(ids)
    torch.testing.assert_close(logits.detach(), tiny.forward_full(ids[None])[0], atol=1e-6, rtol=1e-6)
    torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).backward()
    grads = [p.grad for p in tiny.parameters()]
    assert all(g is not None for g in grads)
    assert tiny.model.layers[0].self_attn.qkv_proj.weight.grad.abs().sum() > 0
