"""Every object the router app shares, as typed ``web.AppKey``s (no string keys, no globals)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from router.gateway.admin.fleet_views import FleetViews
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.locked import AdminContext
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.config import RouterConfig
from router.gateway.data_planes.hub import DataPlaneHub
from router.gateway.discovery.k8s import DiscoveryStatus
from router.gateway.discovery.reconcile import DiscoveredFleet
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.health import HealthChecker
from router.gateway.leader.elector import LeaseElector
from router.gateway.leader.gate import LeaderGate
from router.gateway.metrics import RouterMetrics
from router.gateway.routing.affinity import SessionAffinity
from router.gateway.routing.proxy import GenerateProxy
from router.gateway.state.durable import DurableState
from router.gateway.sync.ranks import GroupInitializer
from router.gateway.sync.two_phase import TwoPhaseCoordinator
from router.gateway.sync.weight_transfer import WeightTransfer
from router.gateway.tasks import TaskSet
from router.gateway.upstream import WorkerClient

CONFIG = web.AppKey("config", RouterConfig)
REGISTRY = web.AppKey("registry", WorkerRegistry)
GATE = web.AppKey("update_gate", UpdateGate)
JOURNAL = web.AppKey("journal", UpdateJournal)
STATE = web.AppKey("durable_state", DurableState)
DATA_PLANES = web.AppKey("data_planes", DataPlaneHub)
"""Only in the control process of a router with data-plane processes."""
METRICS = web.AppKey("metrics", RouterMetrics)
TASKS = web.AppKey("tasks", TaskSet)
SERVICE_HEADERS = web.AppKey("service_headers", dict[str, str])
"""Headers of every call the router makes to workers: JSON, and its worker key (never a caller's)."""

# Created in the cleanup context, once the event loop runs.
WORKERS = web.AppKey("worker_client", WorkerClient)
"""Every HTTP call to a worker (proxy, admin fan-out, probes, metadata, aborts, ``/v1/models``)."""
ADMIN = web.AppKey("admin", AdminContext)
PROXY = web.AppKey("proxy", GenerateProxy)
SESSIONS = web.AppKey("sessions", SessionAffinity)
"""The router's session table (``--session-affinity`` only): the proxy's, and the data planes' through the hub."""
GROUP_INIT = web.AppKey("group_init", GroupInitializer)
TWO_PHASE = web.AppKey("two_phase", TwoPhaseCoordinator)
WEIGHT_TRANSFER = web.AppKey("weight_transfer", WeightTransfer)
VIEWS = web.AppKey("fleet_views", FleetViews)
HEALTH = web.AppKey("health_checker", HealthChecker)
HEALTH_TASK = web.AppKey("health_task", asyncio.Task[None])
DISCOVERY = web.AppKey("discovered_fleet", DiscoveredFleet)
DISCOVERY_STATUS = web.AppKey("discovery_status", DiscoveryStatus)
DISCOVERY_TASKS = web.AppKey("discovery_tasks", list[asyncio.Task[None]])

# Only with --leader-election (router.gateway.leader).
ELECTOR = web.AppKey("lease_elector", LeaseElector)
LEADER_GATE = web.AppKey("leader_gate", LeaderGate)
"""Closed (503 to clients) while this replica is not the leader."""
