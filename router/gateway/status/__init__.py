"""``omni-router status``: a running router's fleet at a glance, for an operator or a script.

    omni-router status [--url URL] [--admin-api-key KEY] [--timeout-s S] [--watch [SECONDS]] [--json]

It reads the router's ``GET /fleet/status`` (one request: the router judges its workers itself, in
:mod:`router.gateway.status.verdict`, and :mod:`router.gateway.api.fleet_status` serves the verdicts)
and prints the workers, the journal's entry and the last recorded fleet versions; the exit status
says whether every worker takes generation traffic (docs/router.md, "Status at a glance").
"""

from __future__ import annotations

from router.gateway.status.command import main

__all__ = ["main"]
