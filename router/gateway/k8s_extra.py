"""The ``k8s`` extra (lightkube): whether it imports, checked at start-up by every flag that needs it.

Discovery, the ConfigMap state store and leader election all need it; the check sits below all three so
that none has to import another for it.
"""

from __future__ import annotations

import importlib

#: The modules of the ``k8s`` extra (lightkube and the HTTP client it is built on).
K8S_EXTRA_MODULES = ("lightkube", "httpx2")
EXTRA_MISSING = "{feature} needs the k8s extra: pip install 'omni-router[k8s]'"


def require_client(feature: str = "--service-discovery k8s") -> None:
    """Raise :class:`RuntimeError` (one line naming ``feature`` and the extra) unless the Kubernetes client imports.

    ``omni-router`` calls it at start-up for every flag that needs it (discovery, ``--state-store k8s``,
    ``--leader-election``), so a router without the extra refuses to start rather than serving with
    that part dead; the plain router never imports lightkube."""
    missing = []
    for name in K8S_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise RuntimeError(f"{EXTRA_MISSING.format(feature=feature)} (cannot import {', '.join(missing)})")
