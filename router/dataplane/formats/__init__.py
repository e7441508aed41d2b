"""The bucket formats, by name: each module holds one format's send and receive side.

==================  =====================  ============================================
name                ``load_format``        one bucket on the wire
==================  =====================  ============================================
``per_tensor``      ``None`` (absent)      one broadcast per tensor, in list order
``flattened_bucket`` ``"flattened_bucket"`` one ``uint8`` broadcast of the packed tensors
==================  =====================  ============================================

:func:`for_load_format` maps a request's ``load_format`` to its format;
:func:`register` adds one (a duplicate name is refused). Over gloo every format
receives each broadcast with :data:`RECEIVE_SLACK_BYTES` of slack and canaries, and
raises :class:`ByteMismatch` when one carried another byte count than announced
(:mod:`router.dataplane.canary`).
"""

from __future__ import annotations

from router.dataplane.canary import RECEIVE_SLACK_BYTES, ByteMismatch, receive_slack
from router.dataplane.formats.base import BucketFormat
from router.dataplane.formats.flattened_bucket import FlattenedBucket
from router.dataplane.formats.per_tensor import PerTensor

_FORMATS: dict[str, BucketFormat] = {}


def register(fmt: BucketFormat) -> None:
    if fmt.name in _FORMATS:
        raise ValueError(f"a bucket format named {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt


def get_format(name: str) -> BucketFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown bucket format {name!r}; registered: {sorted(_FORMATS)}") from None


def for_load_format(load_format: str | None) -> BucketFormat:
    """The format a request's ``load_format`` selects (``None``: one broadcast per tensor)."""
    for fmt in _FORMATS.values():
        if fmt.load_format == load_format:
            return fmt
    known = [f.load_format for f in _FORMATS.values()]
    raise ValueError(f"unknown load_format {load_format!r}; expected one of {known}")


register(PerTensor())
register(FlattenedBucket())

__all__ = [
    "RECEIVE_SLACK_BYTES",
    "BucketFormat",
    "ByteMismatch",
    "FlattenedBucket",
    "PerTensor",
    "for_load_format",
    "get_format",
    "receive_slack",
    "register",
]
