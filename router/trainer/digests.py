"""The digest of the weights an update must leave on the workers, computed by the trainer from its tensors.

Sent with an update (``RouterClient``'s ``expected_checksum``, the ``X-Expected-Weights-Checksum``
header), it lets the router publish the update only once every target reports those weights
(:mod:`router.contract.weight_digest` has each engine's rule). One function, by engine:

- ``omni``: :func:`~router.trainer.sender.sent_checksum` of the checkpoint-named tensors, exactly as
  sent or saved (each tensor's SHA-256 over its name, dtype, shape and bytes; the sorted pairs hashed);
- ``sglang``: SGLang 0.5.23's ``per_gpu_checksum`` for one rank on its CPU path
  (``sglang/srt/utils/weight_checker.py``): each tensor's hash is the first 8 bytes of the SHA-256 of
  its bytes, as 16 hex digits, and the sorted ``name`` + hash pairs are hashed with SHA-256. On a GPU,
  SGLang hashes tensors with a Triton kernel of its own, which a trainer cannot compute off the GPU:
  there the digest to expect is one the servers reported for the same checkpoint;
- ``vllm``: the tensors as vLLM holds them, then each parameter's SHA-256 over its raw bytes, keyed
  ``dp0:pp0:pcp0:tp0:{name}``, folded by :func:`~router.contract.weight_digest.vllm_digest`. vLLM fuses
  the attention projections ``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj`` and the MLP's
  ``gate_proj`` and ``up_proj`` into ``gate_up_proj`` (weights and biases, concatenated in that order on
  the first dimension), and keeps one tensor for tied embeddings. This covers the Llama and Qwen2
  layouts this project serves, at one tensor-parallel rank and in the dtype the engine serves.
  vLLM's CPU build repacks every linear layer's weight for oneDNN after loading and leaves the parameter
  itself empty, so its checker hashes zero bytes for those (the SHA-256 of nothing, ``e3b0c442...``) and
  covers only the embeddings, the norms and ``lm_head`` there: ``vllm_cpu=True`` computes that digest. A
  wrong checkpoint still shows (its embeddings differ); a change confined to linear layers does not, on
  that build. A vLLM server started with ``--enable-lora`` wraps the embeddings and the projections, so
  their parameters are named ``...base_layer.weight``: ``vllm_lora=True``.

A LoRA adapter has its own digest (:func:`expected_adapter_checksum`), which an omni-worker reports
with each load through SGLang's routes; vLLM reports none of an adapter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Literal

import torch

from router.contract.weight_digest import vllm_digest
from router.dataplane.digest import adapter_checksum
from router.trainer.sender import sent_checksum

DigestEngine = Literal["omni", "sglang", "vllm"]

#: vLLM's fused parameters: the fused name's part, and the checkpoint parts it concatenates in order.
VLLM_FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
#: The projections' weights: vLLM's CPU build repacks them (the parameters then hold no bytes), and its LoRA
#: support wraps them.
VLLM_CPU_REPACKED = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)
#: The SHA-256 of zero bytes.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: vLLM's key prefix for the only rank of a server without data, pipeline, context or tensor parallelism.
VLLM_RANK_PREFIX = "dp0:pp0:pcp0:tp0:"


def expected_checksum(
    named: Iterable[tuple[str, torch.Tensor]],
    engine: DigestEngine = "omni",
    *,
    tie_word_embeddings: bool = False,
    vllm_cpu: bool = False,
    vllm_lora: bool = False,
) -> str:
    """The digest ``engine`` reports once it serves exactly ``named`` (checkpoint names; see the module).
    ``tie_word_embeddings``: the model's config ties ``lm_head`` to the embeddings (vLLM then holds one);
    ``vllm_cpu``: the vLLM server is its CPU build (its linear layers' parameters are empty); ``vllm_lora``: it
    serves LoRA adapters (its wrapped layers' parameters are named ``base_layer``)."""
    if engine == "omni":
        return sent_checksum(named)
    if engine == "sglang":
        return _sglang_overall({name: _sglang_tensor_hash(t) for name, t in named})
    params = vllm_parameters(named, tie_word_embeddings=tie_word_embeddings)
    return vllm_digest(
        {
            VLLM_RANK_PREFIX + (_base_layer(n) if vllm_lora else n): EMPTY_SHA256
            if vllm_cpu and _repacked(n)
            else _sha256(t)
            for n, t in params
        }
    )


def expected_adapter_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest an omni-worker reports (``lora_checksum``) once it loaded the LoRA adapter ``named``: its
    ``lora_A`` / ``lora_B`` tensors as PEFT names them (``get_peft_model_state_dict``, or the saved
    ``adapter_model.safetensors``; with or without the ``base_model.model.`` prefix), in the scheme of
    ``sent_checksum``."""
    return adapter_checksum(named)


def vllm_parameters(
    named: Iterable[tuple[str, torch.Tensor]], *, tie_word_embeddings: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """``named`` as vLLM's parameters: the fused projections built, a tied ``lm_head`` dropped."""
    tensors = dict(named)
    out: dict[str, torch.Tensor] = {}
    fused_parts: set[str] = set()
    for name in tensors:
        for fused, parts in VLLM_FUSED:
            head, found, tail = _split(name, parts[0])
            if not found:
                continue
            names = [f"{head}{part}{tail}" for part in parts]
            if all(n in tensors for n in names):
                out[f"{head}{fused}{tail}"] = torch.cat([tensors[n] for n in names], dim=0)
                fused_parts.update(names)
    for name, tensor in tensors.items():
        if name not in fused_parts:
            out[name] = tensor
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)  # one parameter, the embeddings', as vLLM ties them
    return sorted(out.items())


def _repacked(name: str) -> bool:
    return name.endswith(VLLM_CPU_REPACKED)


def _base_layer(name: str) -> str:
    """vLLM's name of a parameter its LoRA support wraps (the embeddings and the projections)."""
    if name == "model.embed_tokens.weight" or name.endswith(VLLM_CPU_REPACKED):
        return name.removesuffix("weight") + "base_layer.weight"
    return name


def _split(name: str, part: str) -> tuple[str, bool, str]:
    """``name`` around ``.part.`` (its head keeps the dot before it): ``(head, found, tail)``."""
    marker = f".{part}."
    at = name.find(marker)
    if at < 0:
        return name, False, ""
    return name[: at + 1], True, name[at + 1 + len(part) :]


def _raw(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(_raw(tensor)).hexdigest()


def _sglang_tensor_hash(tensor: torch.Tensor) -> str:
    return hashlib.sha256(_raw(tensor)).digest()[:8].hex()


def _sglang_overall(hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(hashes):
        h.update(name.encode())
        h.update(hashes[name].encode())
    return h.hexdigest()
