"""Trainer-side client for the router (torch-free): one method per admin call,
sync (:class:`RouterClient`) and async (:class:`AsyncRouterClient`), and
``sync_weights`` for the whole update cycle."""

from router.client.aio import AsyncRouterClient
from router.client.calls import RouterCallError
from router.client.sync import RouterClient
from router.client.weight_sync import GroupSpec, SyncError, SyncReport, WeightSync

__all__ = ["AsyncRouterClient", "GroupSpec", "RouterCallError", "RouterClient", "SyncError", "SyncReport", "WeightSync"]
