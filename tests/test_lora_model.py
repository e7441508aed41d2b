"""LoRA adapters in PEFT's format on the model, against transformers + PEFT with the same adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests._lora_helpers import (
    ADAPTERS,
    edit_config,
    greedy_batch,
    reference_greedy,
    reference_logits,
    write_adapter,
)
from worker.model import (
    CausalLM,
    LoraAdapter,
    LoraAdapters,
    LoraLoadError,
    LoraNotFoundError,
    digest_named_tensors,
    load_model,
)
from worker.model.lora import LoraConfig

pytest.importorskip("transformers")
pytest.importorskip("peft")

ARCHS = ("llama", "qwen2")
PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32], [256, 1, 2, 3], [256, 300, 17, 42, 99, 7, 450, 12, 5]]
STEPS = 6
ATOL = RTOL = 1e-4
MAX_RANK = 16


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, CausalLM]:
    return {arch: load_model(checkpoints[arch]) for arch in ARCHS}


@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """``(arch, label)`` → (adapter directory, the PEFT model that wrote it)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        (arch, label): write_adapter(checkpoints[arch], label, root / f"{arch}-{label}")
        for arch in ARCHS
        for label in ADAPTERS
    }


def _dir(adapters: dict[tuple[str, str], Any], arch: str, label: str) -> Path:
    path: Path = adapters[arch, label][0]
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _registry(model: CausalLM, max_loras: int = 4, max_lora_rank: int = MAX_RANK) -> LoraAdapters:
    return LoraAdapters(model, max_loras=max_loras, max_lora_rank=max_lora_rank)


@pytest.mark.parametrize("label", sorted(ADAPTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_peft(models, adapters, arch, label):
    model = models[arch]
    path, reference = adapters[arch, label]
    loaded = _registry(model).load(label, LoraAdapter.from_dir(path))
    for prompt in PROMPTS:
        got = model.forward_full(torch.tensor(prompt), loaded)[0]
        torch.testing.assert_close(got, reference_logits(reference, prompt), atol=ATOL, rtol=RTOL)
        # The adapter is not a no-op: the base model's logits are far from these.
        assert (got - model.forward_full(torch.tensor(prompt))[0]).abs().max() > 0.1
    tokens, _ = greedy_batch(model, PROMPTS, [loaded] * len(PROMPTS), STEPS)
    assert tokens == [reference_greedy(reference, p, STEPS) for p in PROMPTS]


def test_saved_config_is_what_peft_wrote(adapters):
    config = LoraAdapter.from_dir(_dir(adapters, "llama", "rslora")).config
    assert (config.rank, config.alpha, config.use_rslora) == (4, 8.0, True)
    assert config.scaling == pytest.approx(8 / 2)  # alpha / sqrt(r)
    assert len(config.targets) == 7
    partial = LoraAdapter.from_dir(_dir(adapters, "llama", "partial"))
    assert partial.config.targets == {"v_proj", "down_proj"}
    assert partial.config.scaling == 2.0
    assert {module for _, module in partial.weights} == {"v_proj", "down_proj"}


def test_mixed_batch_gives_each_sequence_its_own_numbers(models, adapters):
    model = models["llama"]
    registry = _registry(model)
    a = registry.load("a", LoraAdapter.from_dir(_dir(adapters, "llama", "plain")))
    b = registry.load("b", LoraAdapter.from_dir(_dir(adapters, "llama", "partial")))
    # a's sequences are not neighbours in the batch: its rows are gathered, not a slice.
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2][:5], [256, 9, 8]]
    chosen = [None, a, b, a, None]
    tokens, logits = greedy_batch(model, prompts, chosen, STEPS)
    for i, (prompt, adapter) in enumerate(zip(prompts, chosen, strict=True)):
        alone_tokens, alone_logits = greedy_batch(model, [prompt], [adapter], STEPS)
        assert tokens[i] == alone_tokens[0]
        # Matrix products round differently with the number of rows, base projections included: the
        # same numbers up to float32 rounding (about 1e-5 here), as for a batch without adapters.
        torch.testing.assert_close(logits[:, i], alone_logits[:, 0], atol=ATOL, rtol=RTOL)
    # One prompt under the base model and under each adapter: three different answers in one batch.
    _, same_prompt = greedy_batch(model, [PROMPTS[2]] * 3, [None, a, b], 0)
    first = same_prompt[0]
    assert (first[0] - first[1]).abs().max() > 0.1 and (first[1] - first[2]).abs().max() > 0.1


def test_mixed_batch_matches_peft_per_sequence(models, adapters):
    model = models["qwen2"]
    registry = _registry(model)
    labels = ["plain", "attn", "partial"]
    loaded = [registry.load(label, LoraAdapter.from_dir(_dir(adapters, "qwen2", label))) for label in labels]
    tokens, _ = greedy_batch(model, [*PROMPTS, PROMPTS[0]], [*loaded, None], STEPS)
    for label, prompt, got in zip(labels, PROMPTS, tokens, strict=False):
        assert got == reference_greedy(adapters["qwen2", label][1], prompt, STEPS)


def _checksum(model: CausalLM) -> str:
    return digest_named_tensors(model.iter_checkpoint_tensors())[1]


def test_base_model_is_unchanged_by_loaded_adapters(checkpoints, adapters):
    model = load_model(checkpoints["llama"])
    before_params = _checksum(model)
    before_tokens, before_logits = greedy_batch(model, PROMPTS, [None] * len(PROMPTS), STEPS)
    before_full = model.forward_full(torch.tensor(PROMPTS[0]))
    registry = _registry(model)
    for label in ("plain", "partial"):
        registry.load(label, LoraAdapter.from_dir(_dir(adapters, "llama", label)))
    after_tokens, after_logits = greedy_batch(model, PROMPTS, [None] * len(PROMPTS), STEPS)
    assert after_tokens == before_tokens
    assert torch.equal(after_logits, before_logits)  # bit for bit: a base-only batch runs the base math only
    assert torch.equal(model.forward_full(torch.tensor(PROMPTS[0])), before_full)
    assert _checksum(model) == before_params


def test_forward_logits_takes_an_adapter(models, adapters):
    model = models["llama"]
    loaded = _registry(model).load("p", LoraAdapter.from_dir(_dir(adapters, "llama", "plain")))
    ids = torch.tensor(PROMPTS[2])
    torch.testing.assert_close(model.forward_logits(ids, loaded), model.forward_full(ids, loaded)[0])


def test_adapter_from_config_and_tensors_equals_the_directory(models, adapters):
    model = models["llama"]
    path = _dir(adapters, "llama", "plain")
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    registry = _registry(model)
    from_tensors = registry.load("t", LoraAdapter.from_tensors(config, tensors))
    from_dir = registry.load("d", LoraAdapter.from_dir(path))
    ids = torch.tensor(PROMPTS[0])
    expected = model.forward_full(ids, from_dir)
    assert torch.equal(model.forward_full(ids, from_tensors), expected)
    for tensor in tensors.values():  # the loaded adapter holds copies, not the caller's tensors
        tensor.zero_()
    assert torch.equal(model.forward_full(ids, from_tensors), expected)


def _rewrite_tensors(path: Path, **changes: torch.Tensor) -> Path:
    """Set tensors of ``path``'s adapter, named by their module path inside the model (``model.layers...``)."""
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors.update({f"base_model.model.{name}": tensor for name, tensor in changes.items()})
    save_file(tensors, str(file))
    return path


BAD_ADAPTERS = {
    "rank above the limit": (lambda a, tmp: _dir(a, "llama", "plain"), {"max_lora_rank": 4}, "max_lora_rank=4"),
    "unknown target": (
        lambda a, tmp: write_adapter(a["llama", "plain"][2], "attn", tmp / "x", target_modules=["q_proj", "lm_head"])[
            0
        ],
        {},
        r"target_modules \['lm_head'\] not supported",
    ),
    "wrong shape": (
        lambda a, tmp: _rewrite_tensors(
            _copy(_dir(a, "llama", "plain"), tmp / "x"),
            **{"model.layers.1.self_attn.k_proj.lora_B.weight": torch.ones(64, 8)},
        ),
        {},
        r"layer 1 k_proj: lora_A \(8, 64\) and lora_B \(64, 8\) do not fit the model's \(8, 64\) and \(32, 8\)",
    ),
    "layer out of range": (
        lambda a, tmp: _rewrite_tensors(
            _copy(_dir(a, "llama", "partial"), tmp / "x"),
            **{
                "model.layers.9.mlp.down_proj.lora_A.weight": torch.ones(6, 128),
                "model.layers.9.mlp.down_proj.lora_B.weight": torch.ones(64, 6),
            },
        ),
        {},
        "down_proj of layer 9: the model has 4 layers",
    ),
    "bias": (lambda a, tmp: edit_config(_copy(_dir(a, "llama", "plain"), tmp / "x"), bias="lora_only"), {}, "bias="),
    "DoRA": (
        lambda a, tmp: write_adapter(a["llama", "plain"][2], "attn", tmp / "x", use_dora=True)[0],
        {},
        "use_dora=True",
    ),
    "regex target": (
        lambda a, tmp: edit_config(_copy(_dir(a, "llama", "plain"), tmp / "x"), target_modules=r".*\.q_proj"),
        {},
        "regular expression is not supported",
    ),
}


@pytest.fixture(scope="module")
def adapters_with_checkpoint(adapters, checkpoints):
    """``adapters`` plus each entry's checkpoint, so a case can make an adapter of its own."""
    return {key: (*value, checkpoints[key[0]]) for key, value in adapters.items()}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapters_are_refused_with_nothing_loaded(models, adapters_with_checkpoint, tmp_path, case):
    make, limits, message = BAD_ADAPTERS[case]
    model = models["llama"]
    registry = _registry(model, **limits)
    kept = registry.load("kept", LoraAdapter.from_dir(_dir(adapters_with_checkpoint, "llama", "rslora")))
    path = make(adapters_with_checkpoint, tmp_path)
    for name in ("new", "kept"):  # neither a new name nor an update of a loaded one
        with pytest.raises(LoraLoadError, match=message):
            registry.load(name, LoraAdapter.from_dir(path))
        assert registry.names() == ["kept"]
        assert registry.get("kept") is kept and kept.version == 1


def test_pickled_adapter_is_refused_unread(models, adapters, tmp_path, monkeypatch):
    peft_model = adapters["llama", "partial"][1]
    peft_model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").exists()
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()

    def no_unpickling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the adapter was unpickled")

    monkeypatch.setattr(torch, "load", no_unpickling)
    registry = _registry(models["llama"])
    with pytest.raises(LoraLoadError, match=r"only adapter_model\.bin, a pickle, which is never loaded"):
        registry.load("bin", LoraAdapter.from_dir(tmp_path / "bin"))
    assert registry.names() == []


def test_update_replaces_atomically_and_bumps_the_version(models, adapters, tmp_path):
    model = models["llama"]
    registry = _registry(model)
    ids = torch.tensor(PROMPTS[1])
    first = registry.load("x", LoraAdapter.from_dir(_dir(adapters, "llama", "plain")))
    assert first.version == 1
    bad = edit_config(_copy(_dir(adapters, "llama", "rslora"), tmp_path / "bad"), r=3)
    with pytest.raises(LoraLoadError, match="r=3"):
        registry.load("x", LoraAdapter.from_dir(bad))
    assert registry.get("x") is first and first.version == 1
    second = registry.load("x", LoraAdapter.from_dir(_dir(adapters, "llama", "rslora")))
    assert second.version == 2 and registry.get("x") is second and registry.names() == ["x"]
    new_reference, old_reference = adapters["llama", "rslora"][1], adapters["llama", "plain"][1]
    expected_new = reference_logits(new_reference, PROMPTS[1])
    torch.testing.assert_close(model.forward_full(ids, registry.get("x"))[0], expected_new, atol=ATOL, rtol=RTOL)
    # A sequence that still holds the replaced adapter finishes with it.
    expected_old = reference_logits(old_reference, PROMPTS[1])
    torch.testing.assert_close(model.forward_full(ids, first)[0], expected_old, atol=ATOL, rtol=RTOL)
    assert registry.unload("x") is second
    with pytest.raises(LoraNotFoundError, match="no adapter 'x' is loaded"):
        registry.get("x")
    with pytest.raises(LoraNotFoundError):
        registry.unload("x")
    assert registry.load("x", LoraAdapter.from_dir(_dir(adapters, "llama", "plain"))).version == 3


def test_max_loras_is_enforced(models, adapters):
    registry = _registry(models["llama"], max_loras=2)
    adapter = LoraAdapter.from_dir(_dir(adapters, "llama", "partial"))
    registry.load("a", adapter)
    registry.load("b", adapter)
    with pytest.raises(LoraLoadError, match=r"max_loras=2 adapters are loaded \(a, b\)"):
        registry.load("c", adapter)
    assert registry.names() == ["a", "b"] and "c" not in registry
    assert registry.load("a", adapter).version == 2  # an update needs no room
    registry.unload("b")
    registry.load("c", adapter)
    assert registry.names() == ["a", "c"] and len(registry) == 2


GOOD_CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj"],
    "bias": "none",
    "lora_dropout": 0.1,
    "rank_pattern": {},
    "use_dora": False,
    "init_lora_weights": True,
}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"a_future_feature": {"on": True}}, "a_future_feature"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"target_modules": "q_proj|v_proj"}, "regular expression"),
        ({"target_modules": []}, "non-empty list"),
        ({"target_modules": ["self_attn.q_proj"]}, "not supported"),
        ({"r": 0}, "positive integer"),
        ({"lora_alpha": "8"}, "lora_alpha"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_config_refusals(fields, message):
    with pytest.raises(LoraLoadError, match=message):
        LoraConfig.from_dict({**GOOD_CONFIG, **fields})


def test_config_forms_peft_allows():
    assert LoraConfig.from_dict(GOOD_CONFIG).scaling == 2.0
    assert LoraConfig.from_dict({**GOOD_CONFIG, "target_modules": "all-linear"}).targets == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert LoraConfig.from_dict({**GOOD_CONFIG, "target_modules": "v_proj"}).targets == {"v_proj"}
    assert LoraConfig.from_dict({**GOOD_CONFIG, "r": 16, "lora_alpha": 8, "use_rslora": True}).scaling == 2.0


def _q_pair(layer: int = 0, rank: int = 2) -> dict[str, torch.Tensor]:
    pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{pre}.lora_A.weight": torch.ones(rank, 64), f"{pre}.lora_B.weight": torch.ones(64, rank)}


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 64)}, "lora_B is missing"),
        ({**_q_pair(), "base_model.model.lm_head.lora_A.weight": torch.ones(2, 64)}, "unexpected tensor"),
        ({**_q_pair(), **{k.replace("q_proj", "v_proj"): v for k, v in _q_pair().items()}}, "not in target_modules"),
        (_q_pair(rank=3), r"with r=2"),
        ({k: v.long() for k, v in _q_pair().items()}, "not a floating-point tensor"),
        ({}, "no lora_A / lora_B tensors"),
    ],
)
def test_tensor_refusals(tensors, message):
    with pytest.raises(LoraLoadError, match=message):
        LoraAdapter.from_tensors(GOOD_CONFIG, tensors)


def test_every_targeted_layer_needs_weights(models):
    adapter = LoraAdapter.from_tensors(GOOD_CONFIG, {**_q_pair(0), **_q_pair(1), **_q_pair(2)})
    registry = _registry(models["llama"])
    with pytest.raises(LoraLoadError, match=r"1 targeted modules have no weights, e\.g\. layer 3 q_proj"):
        registry.load("short", adapter)
    with pytest.raises(LoraLoadError, match="non-empty string"):
        registry.load("", adapter)
    assert registry.names() == []


def test_a_loaded_adapters_checksum_is_the_one_the_trainer_computes(adapters):
    """What an omni-worker reports of an adapter it loaded is what a trainer computes from the adapter it saved,
    PEFT's ``base_model.model.`` prefix on the names or not; another adapter has another."""
    from router.dataplane.digest import PEFT_PREFIX
    from router.trainer.digests import expected_adapter_checksum

    path = _dir(adapters, "llama", "rslora")
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert all(name.startswith(PEFT_PREFIX) for name in saved)
    expected = expected_adapter_checksum(saved.items())
    assert LoraAdapter.from_dir(path).checksum() == expected
    assert expected_adapter_checksum((n.removeprefix(PEFT_PREFIX), t) for n, t in saved.items()) == expected
    config = json.loads((path / "adapter_config.json").read_text())
    assert LoraAdapter.from_tensors(config, saved).checksum() == expected
    assert LoraAdapter.from_dir(_dir(adapters, "llama", "partial")).checksum() != expected
