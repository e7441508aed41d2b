"""``omni-router status``: a running router's fleet at a glance, for an operator or a script.

    omni-router status [--url URL] [--admin-key KEY] [--timeout-s S] [--watch [SECONDS]] [--json]

It reads the router's own routes (``GET /leader``, ``/workers``, ``/weight_update_journal``,
``/fleet/versions``) and prints the workers, the journal's entry and the last recorded fleet
versions; the exit status says whether every worker takes generation traffic (docs/router.md,
"Status at a glance").
"""

from __future__ import annotations

from router.gateway.status.command import main

__all__ = ["main"]
