"""The omni-router gateway: one URL in front of a fleet of inference workers.

Layers, each importing only the ones below it:

- wiring: :mod:`~router.gateway.app` (``create_app``), :mod:`~router.gateway.cli`,
  :mod:`~router.gateway.keys` and the thin handlers in :mod:`router.gateway.api`;
- :mod:`router.gateway.admin`: admin operations broadcast to the fleet under the
  update lock (fencing, the journal, rank planning, the two-phase barrier);
- :mod:`router.gateway.routing`: generation traffic (pick a worker, proxy, retry);
- :mod:`router.gateway.fleet`: the worker registry and health checking;
- :mod:`router.gateway.upstream`: the one client every layer above reaches workers with
  (``fetch`` for a whole typed answer, ``stream`` for the proxy; the transport chosen by
  URL scheme in one place, every wait from the endpoint budget table).

:mod:`~router.gateway.config`, :mod:`~router.gateway.metrics` and
:mod:`~router.gateway.tasks` are leaves every layer may use.

From outside, the gateway imports only :mod:`router.contract` (and ``router.__version__``): never :mod:`router.dataplane`,
:mod:`router.trainer`, :mod:`worker` or torch, so a bare ``pip install omni-router`` runs it
(Kubernetes discovery needs the ``k8s`` extra). Nothing outside imports the gateway.
"""
