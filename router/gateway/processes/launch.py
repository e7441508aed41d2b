"""How ``omni-router`` runs as a control process with data planes, or as one of those data planes."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence

from aiohttp import web

from router.gateway.config import RouterConfig
from router.gateway.data_planes.handoff import HandoffSite, handoff_path
from router.gateway.data_planes.supervisor import DataPlaneSupervisor
from router.gateway.frontend.site import lean_tcp
from router.gateway.processes.control import attach_data_planes
from router.gateway.processes.data_plane import create_data_plane_app
from router.gateway.serving import Hooks, serve, tcp, unix

log = logging.getLogger("router")

#: ``--data-plane-processes auto``: one per usable core, at most this many.
MAX_AUTO = 8


def data_plane_count(value: str) -> int:
    """``auto`` (one per usable core, capped) or a positive number; 1 means one process, no split."""
    if value == "auto":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return max(1, min(cores, MAX_AUTO))
    count = int(value)
    if count < 1:
        raise ValueError(f"--data-plane-processes must be >= 1 or auto, got {value}")
    return count


async def run_control(
    app: web.Application,
    config: RouterConfig,
    argv: Sequence[str],
    *,
    count: int,
    host: str,
    port: int,
    ack_timeout_s: float,
) -> None:
    """Serve ``app`` on a private Unix socket and keep ``count`` data planes on ``host:port``."""
    run_dir = tempfile.mkdtemp(prefix="omni-router-")  # 0700: only this user reaches the control socket
    socket_path = os.path.join(run_dir, "control.sock")
    supervisor = DataPlaneSupervisor(argv, count, socket_path, grace_s=config.shutdown_grace_s)
    attach_data_planes(app, supervisor, ack_timeout_s=ack_timeout_s)

    def started(_addresses: list[str]) -> None:
        log.info(
            "omni-router control process ready; starting %d data-plane processes on http://%s:%s "
            "(workers=%d policy=%s admin_auth=%s state_dir=%s discovery=%s)",
            count,
            host,
            port,
            len(config.worker_urls),
            config.policy,
            "on" if config.admin_api_key else "off",
            config.state_dir,
            config.service_discovery,
        )
        supervisor.start()

    try:
        # Besides its HTTP socket, the socket on which data planes hand over callers' admin connections.
        def listen(runner: web.AppRunner) -> list[web.BaseSite]:
            return [*unix(socket_path)(runner), HandoffSite(runner, handoff_path(socket_path))]

        await serve(app, listen, config.shutdown_grace_s, Hooks(on_started=started, on_stopping=supervisor.stop))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def run_data_plane(
    config: RouterConfig, *, socket_path: str, index: int, host: str, port: int, lean: bool = True
) -> None:
    """One data plane: listen on ``host:port`` beside its siblings once the first snapshot is in; its generation
    routes served by the lean server (:mod:`router.gateway.frontend`) unless ``lean`` is off."""
    app = create_data_plane_app(config, socket_path, index)

    def started(addresses: list[str]) -> None:
        log.info("data-plane process %d serving on http://%s:%s (pid %d)", index, host, port, os.getpid())

    listen = (lean_tcp if lean else tcp)(host, port, reuse_port=True)
    await serve(app, listen, config.shutdown_grace_s, Hooks(on_started=started))
