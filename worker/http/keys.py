"""Typed application keys of the worker app (the one place they are defined)."""

from __future__ import annotations

from aiohttp import web

from worker.config import WorkerConfig
from worker.coordinator import Coordinator

COORDINATOR = web.AppKey("coordinator", Coordinator)
"""The event-loop facade over the stage and its scheduler threads; extension
route modules (weight sync) reach the scheduler through it."""

CONFIG = web.AppKey("config", WorkerConfig)
