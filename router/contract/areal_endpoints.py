"""AReaL's vLLM server's pause and continue as endpoint rows (:mod:`router.contract.areal`).

A router serves them to AReaL's ``RemotevLLMEngine`` as the fleet's pause and continue: each worker gets
the route its engine serves for them (``router.gateway.engines``), and a real AReaL vLLM server gets these.
Their budgets are vLLM's ``/pause`` and ``/resume``'s: an abort-mode pause ends what runs and returns.
"""

from __future__ import annotations

from router.contract import areal
from router.contract.budget import Budget
from router.contract.endpoint import POST, AnyEndpoint, Endpoint

AREAL_PAUSE_GENERATION = Endpoint(
    areal.AREAL_PAUSE_GENERATION_PATH,
    POST,
    areal.ArealControlRequest,
    areal.ArealControlResult,
    Budget(300.0),
    serialized=True,
    timeout_field=None,
    summary="Pause generation, aborting every request and dropping the cache (AReaL's vLLM server)",
)
AREAL_CONTINUE_GENERATION = Endpoint(
    areal.AREAL_CONTINUE_GENERATION_PATH,
    POST,
    areal.ArealControlRequest,
    areal.ArealControlResult,
    Budget(30.0),
    serialized=True,
    timeout_field=None,
    summary="Continue generation (AReaL's vLLM server)",
)

#: The routes a real AReaL vLLM server serves beside vLLM's.
AREAL_ADMIN: tuple[AnyEndpoint, ...] = (AREAL_PAUSE_GENERATION, AREAL_CONTINUE_GENERATION)
