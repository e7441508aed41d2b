"""The control process's wiring: the hub on the app, and the fence barrier through it.

:func:`attach_data_planes` turns a router app (what :func:`~router.gateway.app.create_app`
builds) into the control process of a router with data-plane processes: the hub's route on its
Unix socket, the hub's publisher in the app's cleanup context, and the hub as the admin
operations' :class:`~router.gateway.admin.locked.FenceBarrier`, and, with leader election, the
gate's state in every snapshot (:mod:`.leader_mirror`). Everything else in the app
is unchanged; it is simply reached through the data planes.
"""

from __future__ import annotations

from aiohttp import web

from router.gateway import keys
from router.gateway.data_planes.hub import HUB_PATH, DataPlaneHub
from router.gateway.data_planes.leader_mirror import gate_view
from router.gateway.data_planes.supervisor import DataPlaneSupervisor

#: How long a fenced operation waits for every data plane's acknowledgement before it fails closed.
DEFAULT_ACK_TIMEOUT_S = 5.0


def attach_data_planes(
    app: web.Application, supervisor: DataPlaneSupervisor, *, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S
) -> DataPlaneHub:
    gate, elector = app.get(keys.LEADER_GATE), app.get(keys.ELECTOR)
    if gate is not None:  # a standby's data planes connect too: they learn from it that they must refuse
        gate.passes.add(HUB_PATH)
    hub = DataPlaneHub(
        app[keys.REGISTRY],
        ack_timeout_s=ack_timeout_s,
        restart=supervisor.restart,
        gate=(lambda: gate_view(gate, elector)) if gate is not None and elector is not None else None,
        sessions=app.get(keys.SESSIONS),
    )
    supervisor.on_exit = hub.forget
    app[keys.METRICS].control.data_planes = supervisor  # its restarts, exported by the control process
    app[keys.DATA_PLANES] = hub
    app.router.add_get(HUB_PATH, hub.handle)
    app.middlewares.append(hub.settle_middleware)
    app.cleanup_ctx.append(hub.run_ctx)
    return hub
