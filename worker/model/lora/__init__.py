"""LoRA adapters in PEFT's format, served unmerged: several at once, chosen per sequence.

:class:`LoraAdapter` reads an adapter (a PEFT directory, or its config and
tensors); :class:`LoraAdapters` places adapters on a model by name; a sequence
names its :class:`LoadedLora` in :class:`~worker.model.causal_lm.SeqInput`, and
the forward pass adds each adapter's update to its own sequences' rows only.
"""

from worker.model.lora.adapter import LoraAdapter, LoraPair
from worker.model.lora.batch import LoraBatch
from worker.model.lora.config import TARGET_MODULES, LoraConfig, LoraLoadError
from worker.model.lora.loaded import LoadedLora, Placement, ProjectionLora, place_adapter
from worker.model.lora.registry import LoraAdapters, LoraNotFoundError

__all__ = [
    "TARGET_MODULES",
    "LoadedLora",
    "LoraAdapter",
    "LoraAdapters",
    "LoraBatch",
    "LoraConfig",
    "LoraLoadError",
    "LoraNotFoundError",
    "LoraPair",
    "Placement",
    "ProjectionLora",
    "place_adapter",
]
