"""AReaL's vLLM server's own pause and continue (areal 1.0.4, ``areal/engine/vllm_ext/areal_vllm_server.py``).

AReaL's ``RemotevLLMEngine`` posts ``POST /areal_pause_generation`` and ``POST /areal_continue_generation``
with the JSON body ``{}`` to every server it knows. Its server pauses vLLM's engine with
``pause_generation(wait_for_inflight_requests=False, clear_cache=True)`` (every running and waiting
request aborted, the prefix cache dropped), holds its ``/v1/completions`` until the continue, and answers
``{"success": true, "message": ...}`` (200; 400 with ``success: false``). AReaL's client reads only the
status: any 2xx is done.
"""

from __future__ import annotations

from router.contract.admin import AdminResult
from router.contract.base import WireRequest

AREAL_PAUSE_GENERATION_PATH = "/areal_pause_generation"
AREAL_CONTINUE_GENERATION_PATH = "/areal_continue_generation"


class ArealControlRequest(WireRequest):
    """The body of both routes: AReaL sends ``{}`` (its server reads none)."""


class ArealControlResult(AdminResult):
    """AReaL's server's answer ``{"success", "message"}``. Behind a router each worker's answer to the route it
    was sent in AReaL's stead is read into this shape: ``relayed_as`` names that route, ``message`` what the
    worker said, ``weights`` what it said of its weights (a pause writes none)."""

    success: bool = True
    relayed_as: str | None = None
