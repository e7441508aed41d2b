"""The keyword ``TypedDict`` s of the trainer client's calls name exactly their request model's fields."""

from __future__ import annotations

import pytest

from router.contract.admin import UpdateWeightsFromDiskRequest, UpdateWeightsFromTensorRequest
from router.contract.lora import LoadLoraAdapterFromTensorsRequest
from router.trainer.call_fields import DiskUpdateFields, LoraTensorsFields, TensorUpdateFields


@pytest.mark.parametrize(
    ("fields", "model", "positional"),
    [
        (DiskUpdateFields, UpdateWeightsFromDiskRequest, {"model_path"}),
        (TensorUpdateFields, UpdateWeightsFromTensorRequest, set()),
        (
            LoraTensorsFields,
            LoadLoraAdapterFromTensorsRequest,
            {"lora_name", "config_dict", "serialized_named_tensors"},
        ),
    ],
)
def test_keywords_are_the_model_fields(fields: type, model: type, positional: set[str]) -> None:
    # A field added to the wire model is a keyword the call must accept (and one removed, one it must not).
    assert set(fields.__annotations__) == set(model.model_fields) - positional
    assert not fields.__required_keys__
