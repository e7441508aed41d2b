"""The type of an operation a rank runs on its own scheduler state (rank 0 and every follower alike).

Rank 0 sends such operations to the followers (:mod:`worker.tp.peers`) and runs its own
(:mod:`worker.ranks`); the operation must be picklable to reach a follower's process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.engine.results import OpResult
from worker.engine.scheduler import Scheduler

#: ``op(scheduler)`` → that rank's typed outcome.
RankOp = Callable[[Scheduler], OpResult[Any]]
