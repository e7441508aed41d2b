"""The trainer's digest of the weights an update must leave, per engine (router.trainer.digests): each engine's
rule on tensors made here. That each equals what a real engine reports is shown in the engine tier
(tests/engines/test_vllm_update_proof.py, test_sglang_fleet.py) and, for omni-worker, in test_update_proof.py."""

from __future__ import annotations

import hashlib

import torch

from router.contract.weight_digest import vllm_digest
from router.trainer.digests import EMPTY_SHA256, expected_checksum, vllm_parameters
from router.trainer.sender import sent_checksum


def layer(prefix: str = "model.layers.0.") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "self_attn.q_proj.weight": (8, 4),
        "self_attn.k_proj.weight": (4, 4),
        "self_attn.v_proj.weight": (4, 4),
        "self_attn.q_proj.bias": (8,),
        "self_attn.k_proj.bias": (4,),
        "self_attn.v_proj.bias": (4,),
        "self_attn.o_proj.weight": (4, 8),
        "mlp.gate_proj.weight": (6, 4),
        "mlp.up_proj.weight": (6, 4),
        "mlp.down_proj.weight": (4, 6),
    }
    named = {prefix + name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    named["model.embed_tokens.weight"] = torch.randn(10, 4, generator=g)
    named["lm_head.weight"] = named["model.embed_tokens.weight"].clone()
    return named


def test_vllm_fuses_the_projections_in_order_and_keeps_one_tied_embedding() -> None:
    named = layer()
    params = dict(vllm_parameters(named.items(), tie_word_embeddings=True))
    assert set(params) == {
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    }
    qkv = ("q_proj", "k_proj", "v_proj")
    expected = torch.cat([named[f"model.layers.0.self_attn.{p}.weight"] for p in qkv])
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"], expected)
    expected_bias = torch.cat([named[f"model.layers.0.self_attn.{p}.bias"] for p in qkv])
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.bias"], expected_bias)
    gate_up = torch.cat([named["model.layers.0.mlp.gate_proj.weight"], named["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(params["model.layers.0.mlp.gate_up_proj.weight"], gate_up)
    assert "lm_head.weight" in dict(vllm_parameters(named.items()))  # untied: two tensors


def test_each_engines_digest_follows_its_rule() -> None:
    named = layer()
    assert expected_checksum(named.items()) == sent_checksum(named.items())
    # vLLM: each parameter's SHA-256 of its bytes, keyed by rank, folded; the CPU build's projections hash nothing.
    params = vllm_parameters(named.items())

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()

    assert expected_checksum(named.items(), "vllm") == vllm_digest({f"dp0:pp0:pcp0:tp0:{n}": sha(t) for n, t in params})
    on_cpu = {
        f"dp0:pp0:pcp0:tp0:{n.removesuffix('weight') + 'base_layer.weight' if n.endswith(('proj.weight', 'embed_tokens.weight')) else n}": (
            EMPTY_SHA256 if n.endswith("proj.weight") else sha(t)
        )
        for n, t in params
    }
    assert expected_checksum(named.items(), "vllm", vllm_cpu=True, vllm_lora=True) == vllm_digest(on_cpu)
    # SGLang: the first 8 bytes of each tensor's SHA-256, then the sorted name + hash pairs.
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(
            name.encode()
            + hashlib.sha256(named[name].contiguous().view(-1).view(torch.uint8).numpy().data)
            .digest()[:8]
            .hex()
            .encode()
        )
    assert expected_checksum(named.items(), "sglang") == h.hexdigest()
    # Any change to any tensor changes every engine's digest (the CPU build's projections aside).
    changed = {**named, "model.embed_tokens.weight": named["model.embed_tokens.weight"] + 1}
    for engine in ("omni", "sglang", "vllm"):
        assert expected_checksum(changed.items(), engine) != expected_checksum(named.items(), engine)  # type: ignore[arg-type]
