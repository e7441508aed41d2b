"""A PEFT LoRA ``adapter_config.json``: the fields that decide the math, checked.

Only plain LoRA is served: one rank and one alpha for every targeted module, no
bias, no DoRA, no per-layer selection. PEFT writes every field of its config,
most of them with falsy defaults; a field that changes the forward pass when
set is refused when it is set, and a field this module does not know is
refused when truthy, since it may change the math in a way that would go
unnoticed (a newer PEFT feature). Fields that only matter while training or
initialising (dropout, ``init_lora_weights``, LoftQ/EVA/CorDA settings...) are
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: The projections an adapter may target, with the sub-module of the decoder layer holding each.
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
#: PEFT's shorthand for every linear layer but the output head: on these models, all of :data:`TARGET_MODULES`.
ALL_LINEAR = "all-linear"

# Fields read and checked below, and fields that do not change a forward pass (training, initialisation,
# bookkeeping, or only meaningful together with a field that is refused when set).
_CHECKED = frozenset(
    {"r", "lora_alpha", "target_modules", "use_rslora", "bias", "fan_in_fan_out", "modules_to_save", "peft_type"}
)
_INERT = frozenset(
    {
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "lora_dropout",
        "init_lora_weights",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "runtime_config",
        "megatron_config",
        "megatron_core",
        "layers_pattern",
        "qalora_group_size",
        "ensure_weight_tying",
    }
)


class LoraLoadError(ValueError):
    """An adapter that cannot be served; raised before any loaded adapter changes."""


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one :class:`LoraLoadError` naming the first few ``problems`` found in ``what``, if any."""
    if problems:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise LoraLoadError(f"{len(problems)} problem(s) in {what}: {shown}{more}")


@dataclass(frozen=True)
class LoraConfig:
    """What of ``adapter_config.json`` the forward pass uses."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str]
    """Names from :data:`TARGET_MODULES`."""

    @property
    def scaling(self) -> float:
        """PEFT's factor on ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` for rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LoraConfig:
        if not isinstance(data, Mapping):
            raise LoraLoadError(f"adapter config must be a JSON object, not {type(data).__name__}")
        peft_type = data.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise LoraLoadError(f"peft_type={peft_type!r} is not supported (only LORA)")
        unsupported = sorted(key for key, value in data.items() if key not in _CHECKED | _INERT and value)
        if unsupported:
            shown = ", ".join(f"{key}={data[key]!r}" for key in unsupported)
            raise LoraLoadError(f"adapter config sets {shown}: not supported (plain LoRA only)")
        bias = data.get("bias", "none")
        if bias != "none":
            raise LoraLoadError(f"bias={bias!r} is not supported (only 'none': adapters without bias terms)")
        if data.get("fan_in_fan_out"):
            raise LoraLoadError(
                "fan_in_fan_out=true is not supported (it is for Conv1D layers, which these models lack)"
            )
        if data.get("modules_to_save"):
            raise LoraLoadError(
                f"modules_to_save={data['modules_to_save']!r} is not supported: an adapter may not replace whole modules"
            )
        rank = data.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LoraLoadError(f"r must be a positive integer, not {rank!r}")
        alpha = data.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise LoraLoadError(f"lora_alpha must be a finite number, not {alpha!r}")
        use_rslora = data.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise LoraLoadError(f"use_rslora must be true or false, not {use_rslora!r}")
        return cls(rank, float(alpha), use_rslora, _targets(data.get("target_modules")))


def _targets(value: object) -> frozenset[str]:
    supported = ", ".join(TARGET_MODULES)
    if value == ALL_LINEAR:
        return frozenset(TARGET_MODULES)
    if isinstance(value, str):
        if value in TARGET_MODULES:
            return frozenset({value})
        # PEFT matches a string as a regular expression against full module paths.
        raise LoraLoadError(
            f"target_modules={value!r}: a regular expression is not supported; give a list of module names ({supported})"
        )
    if not isinstance(value, list | tuple) or not value:
        raise LoraLoadError(f"target_modules must be a non-empty list of module names ({supported}), not {value!r}")
    unknown = [name for name in value if name not in TARGET_MODULES]
    if unknown:
        raise LoraLoadError(f"target_modules {unknown!r} not supported; an adapter may target {supported}")
    return frozenset(value)
