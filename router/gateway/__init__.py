"""The omni-router gateway: one URL in front of a fleet of inference workers.

Its sub-packages and root modules stand on floors, each importing only its own floor (never in a loop)
and the floors below: from the leaves (:mod:`~router.gateway.config`, :mod:`~router.gateway.tasks`,
:mod:`router.gateway.upstream`, the one client every layer above reaches workers with), through the
registry (:mod:`router.gateway.fleet`), the engines, generation traffic (:mod:`router.gateway.routing`) and
the admin operations (:mod:`router.gateway.admin`) with the protocols built on them, up to the app's keys,
the thin handlers (:mod:`router.gateway.api`), :mod:`~router.gateway.app` and :mod:`~router.gateway.cli`.
docs/architecture.md ("The gateway's floors") lists every floor; ``tests/test_import_rules.py`` checks them.

From outside, the gateway imports only :mod:`router.contract` (and ``router.__version__``): never :mod:`router.dataplane`,
:mod:`router.trainer`, :mod:`worker` or torch, so a bare ``pip install omni-router`` runs it
(Kubernetes discovery needs the ``k8s`` extra). Nothing outside imports the gateway.
"""
