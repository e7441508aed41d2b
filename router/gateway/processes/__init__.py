"""The processes of a router with data-plane processes (``--data-plane-processes N``), each as an app:
the control process with its hub and supervisor attached (:mod:`.control`), a data plane's own app
(:mod:`.data_plane`), and how each is started (:mod:`.launch`).

They build on the router's app (its route table, its keys), so they sit above it; the parts the app's
objects use (the hub, the snapshots and the mirror, the relay to the control process, the supervisor)
are :mod:`router.gateway.data_planes`, below it.
"""
