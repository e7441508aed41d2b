"""Several data-plane processes behind one port, and the one control process that owns the fleet.

With ``--data-plane-processes N`` (N > 1) the router runs as:

* **one control process**: the registry, health probing, discovery, the admin update lock,
  fences, the journal, the fleet's weights and groups — everything today's single process
  owns. It listens on a private Unix socket only (:mod:`.supervisor` starts and restarts the
  data planes; :mod:`.hub` talks to them).
* **N data-plane processes**, each listening on the public port with ``SO_REUSEPORT`` (the
  kernel spreads connections over them): each serves the generation routes itself from a
  mirror of the control process's routing state and forwards every other route (admin,
  registry, metrics, health) to the control process over its Unix socket (:mod:`router.gateway.processes.data_plane`,
  :mod:`.forward`).

The routing state travels as versioned snapshots (:mod:`.messages`): every change the control
process makes is published at once, and a keepalive follows every 2 s. A fenced operation sends
nothing to any worker until every live data plane has acknowledged the snapshot that fences its
targets (:meth:`.hub.DataPlaneHub.confirm`); a data plane applies a snapshot synchronously
on its event loop before it acknowledges, and checks the worker it picked is still routable right
before it writes a request's first byte, so after the acknowledgement no new request reaches a
fenced worker from any process. A data plane that does not acknowledge in time fails the
operation closed (503, nothing sent) and is restarted; one that dies is restarted, and only its
own requests in flight are lost.

This package holds what the app's objects use (the hub, the snapshots, the mirror, the relay, the
supervisor); each process's app, built on the router's app, is :mod:`router.gateway.processes`.
"""
