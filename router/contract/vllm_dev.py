"""vLLM's dev RL routes besides the weight-transfer API: sleep and wake, and aborting requests.

As vLLM 0.31 serves them (``vllm/entrypoints/serve/dev/sleep`` and ``.../dev/rlhf``), what SkyRL's
``RemoteInferenceClient`` calls:

* ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` — vLLM pauses the scheduler in ``mode`` and, at
  level 1 or 2, frees the accelerator memory: level 1 offloads the weights to host memory and drops
  the KV cache, level 2 drops both. Here: the same pause, then ``/release_memory_occupation`` —
  level 1 keeps a host copy of the weights (a wake restores them bit for bit), level 2 frees them
  without one, and after the wake the weights are ``partial``: the worker serves nothing until
  updates have rewritten every tensor (vLLM would serve whatever the fresh memory holds). ``tags``
  (which SkyRL sends and vLLM ignores) limits what is freed. ``keep`` at level 1 or 2 retracts the
  running requests (their KV is dropped; they recompute and finish after the wake) instead of
  freezing them with KV that is about to be freed.
* ``POST /wake_up?tags=weights&tags=kv_cache`` — restores what is asleep (no tags: everything;
  ``scheduling`` alone: nothing); once nothing is asleep any more, generation resumes, as vLLM
  resumes its scheduler when it is fully awake.
* ``GET /is_sleeping`` — ``{"is_sleeping": bool}``: true while generation is paused or any memory is
  released (vLLM's engine: scheduler paused or executor asleep).
* ``POST /abort_requests`` — ``{"request_ids": [...]}`` aborts those requests (by the id their
  answers carry, e.g. ``generate-tokens-<id>``, with all their choices), none or empty aborts every
  request; → ``{"status": "aborted", "aborted": n}`` with the number of requests it ended.

The query parameters are read as vLLM reads them (a repeated ``tags`` is a list); a JSON body with
the same fields is accepted too (a router forwards both). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from router.contract.admin import AdminResult, MemoryTag
from router.contract.base import MAX_ITEMS, Label, WireRequest, WireResponse
from router.contract.vllm import VllmPauseMode
from router.contract.weight_sync import TimeoutS, _check_timeout

#: ``wake_up``'s tags: the memory tags, and vLLM's ``scheduling`` (a level-0 sleep's pause).
WakeTag = Literal["weights", "kv_cache", "cuda_graph", "scheduling"]
#: The scheduler mode each vLLM pause mode becomes when memory is freed too (level 1 or 2): ``keep``
#: cannot freeze requests with KV that is being freed, so they are retracted and recompute later.
SLEEP_PAUSE_MODE: dict[str, str] = {"abort": "abort", "wait": "drain", "keep": "retract"}


def _dedupe(tags: list[str] | None) -> list[str] | None:
    return list(dict.fromkeys(tags)) if tags else None


class SleepQuery(WireRequest):
    """``POST /sleep``: ``level`` (vLLM's default 1), ``mode`` (default ``abort``), optional ``tags``."""

    level: int = Field(1, ge=0, le=2)
    mode: VllmPauseMode = "abort"
    tags: Annotated[list[MemoryTag], Field(max_length=8)] | None = None
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)
    _tags = field_validator("tags")(_dedupe)

    @property
    def keep_weights(self) -> bool:
        """Level 1 offloads the weights (a host copy); level 2 discards them."""
        return self.level < 2


class WakeUpQuery(WireRequest):
    """``POST /wake_up``: ``tags`` to restore; none means everything."""

    tags: Annotated[list[WakeTag], Field(max_length=8)] | None = None

    _tags = field_validator("tags")(_dedupe)

    def memory_tags(self) -> list[str] | None:
        """The memory to restore: ``None`` for all of it, ``[]`` for none (``scheduling`` alone)."""
        if self.tags is None:
            return None
        return [t for t in self.tags if t != "scheduling"]


class SleepResult(AdminResult):
    """``/sleep``'s answer (vLLM answers an empty 200): what was released, and the pause it took."""

    success: bool = True
    level: int | None = None
    released: list[str] | None = None
    is_sleeping: bool | None = None


class WakeUpResult(AdminResult):
    """``/wake_up``'s answer (vLLM answers an empty 200): what was restored, and whether anything sleeps still."""

    success: bool = True
    resumed: list[str] | None = None
    is_sleeping: bool | None = None


class IsSleepingResponse(WireResponse):
    """``GET /is_sleeping``."""

    is_sleeping: bool


class AbortRequestsRequest(WireRequest):
    """``POST /abort_requests``: ``request_ids`` (one id or a list); missing, null, ``""`` or ``[]`` aborts
    every request, as vLLM's ``if request_ids:`` does."""

    request_ids: Label | Annotated[list[Label], Field(max_length=MAX_ITEMS)] | None = None

    @property
    def abort_all(self) -> bool:
        return not self.request_ids

    def ids(self) -> list[str]:
        ids = self.request_ids
        if not ids:
            return []
        return [ids] if isinstance(ids, str) else list(ids)


class AbortRequestsResult(AdminResult):
    """vLLM's ``{"status": "aborted", "aborted": n}``; ``n`` counts the requests this call ended."""

    success: bool = True
    status: str = "aborted"
    aborted: int = 0
