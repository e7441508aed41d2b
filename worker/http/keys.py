"""Typed application keys of the worker app (the one place they are defined)."""

from __future__ import annotations

from aiohttp import web

from worker.adapters import AdapterService
from worker.config import WorkerConfig
from worker.coordinator import Coordinator
from worker.transfer.group.controller import WeightSyncController
from worker.transfer.vllm.engine import VllmWeightTransfer

COORDINATOR = web.AppKey("coordinator", Coordinator)
"""The event-loop facade over the stage and its scheduler threads."""

CONFIG = web.AppKey("config", WorkerConfig)

WEIGHT_SYNC = web.AppKey("weight_sync", WeightSyncController)
"""The per-worker weight-sync controller (groups and the update in flight)."""

VLLM_TRANSFER = web.AppKey("vllm_transfer", VllmWeightTransfer)
"""vLLM's weight-transfer engine state (its group and the update open between start and finish)."""

ADAPTERS = web.AppKey("adapters", AdapterService)
"""The LoRA adapters the worker serves (``--enable-lora``), and which one a request names."""
