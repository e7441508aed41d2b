"""What a trainer imports: the router client, the sync driver and the torch sender.

The HTTP client (:class:`RouterClient`, :class:`AsyncRouterClient`) and the sync
driver (:class:`WeightSync`, behind ``RouterClient.sync_weights``, whose keywords are
:class:`SyncOptions`) are torch-free. The sender (:class:`TrainerWeightSender`,
:class:`BucketPlan`, :func:`sent_checksum`) needs torch (``pip install
'omni-router[trainer]'``) and is imported on first use, so importing this package
never pulls torch in. It builds on :mod:`router.contract` and :mod:`router.dataplane`
only; the servers (:mod:`router.gateway`, :mod:`worker`) never import it::

    from router.trainer import BucketPlan, GroupSpec, RouterClient, TrainerWeightSender
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from router.trainer.aio import AsyncRouterClient
from router.trainer.calls import RouterCallError
from router.trainer.client import RouterClient
from router.trainer.driver import GroupSpec, SyncError, SyncReport, WeightSync
from router.trainer.options import SyncOptions

if TYPE_CHECKING:
    from router.trainer.sender import BucketPlan, TrainerWeightSender, sent_checksum

#: Names served from :mod:`router.trainer.sender` (torch) on first access.
_TORCH_NAMES = frozenset({"BucketPlan", "TrainerWeightSender", "sent_checksum"})

__all__ = [
    "AsyncRouterClient",
    "BucketPlan",
    "GroupSpec",
    "RouterCallError",
    "RouterClient",
    "SyncError",
    "SyncOptions",
    "SyncReport",
    "TrainerWeightSender",
    "WeightSync",
    "sent_checksum",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("router.trainer.sender"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
