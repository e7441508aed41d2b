"""The state of a rank's weights, as an explicit state machine.

::

                 streamed bucket applied            commit (whole model written since PARTIAL, or began SERVING)
      SERVING ─────────────────────────► WRITING ─────────────────────────────► SERVING
        │ ▲  ▲                            │   │ commit (part of a PARTIAL model rewritten)
        │ │  │ atomic apply ok            │   └────────────────────────────────► PARTIAL
        │ │  └─ (rollback restores)       │ fail / abort after a bucket was applied
        │ │                               ▼
        │ │                            PARTIAL ──► WRITING (a later streaming update) ...
        │ │ resume                        │  atomic or disk apply covering every tensor ──► SERVING
        ▼ │                               │
      RELEASED ◄──────── release ─────────┘   (resume goes back to the state it was released from)

- ``SERVING``: one consistent version; generation may run.
- ``WRITING``: a streaming update is rewriting the weights bucket by bucket; its
  buckets apply between forward steps while generation is held.
- ``PARTIAL``: a mix of versions (a streaming update failed or was aborted after
  applying buckets, or a rollback itself failed). Nothing is generated until
  updates since then have rewritten every tensor, or a disk reload replaces them all.
- ``RELEASED``: moved to host memory by ``/release_memory_occupation``; resume
  restores them bit for bit, into the state they were released from.

An atomic update (a disk reload, an atomic or single-phase distributed update)
never leaves ``SERVING``: it writes every tensor in one scheduler step and rolls
back on failure; only a failed rollback ends in ``PARTIAL``. Every transition
runs on the rank's scheduler thread; other threads only read :attr:`WeightLedger.state`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

from router.contract.admin import WeightsEffect


class WeightState(enum.StrEnum):
    SERVING = "serving"
    WRITING = "writing"
    PARTIAL = "partial"
    RELEASED = "released"


class WeightStateError(RuntimeError):
    """A transition the state machine does not allow (a bug in the caller, not a caller's mistake)."""


class WeightLedger:
    """One rank's :class:`WeightState` and what must still be rewritten to leave ``PARTIAL``."""

    def __init__(self, names: Collection[str]):
        self.state = WeightState.SERVING
        self._names = frozenset(names)
        #: Since the weights became PARTIAL: the tensors rewritten by successful updates.
        self._rewritten: set[str] | None = None
        #: While WRITING: the state the streaming update started from.
        self._writing_from: WeightState | None = None
        #: While RELEASED: the state to resume into.
        self._released_from: WeightState | None = None

    @property
    def servable(self) -> bool:
        return self.state is WeightState.SERVING

    @property
    def mixed(self) -> bool:
        """The weights are (or are being made) a mix of versions: ``weights_partial`` in ``/model_info``."""
        return self.state in (WeightState.WRITING, WeightState.PARTIAL) or self._released_from is WeightState.PARTIAL

    def _require(self, *allowed: WeightState) -> None:
        if self.state not in allowed:
            raise WeightStateError(f"weights are {self.state.value}; expected {' or '.join(s.value for s in allowed)}")

    # -- streaming updates

    def begin_writing(self) -> None:
        """The first bucket of a streaming update is about to be written."""
        if self.state is WeightState.WRITING:
            return
        self._require(WeightState.SERVING, WeightState.PARTIAL)
        self._writing_from = self.state
        if self.state is WeightState.SERVING:
            self._rewritten = None
        self.state = WeightState.WRITING

    def writing_failed(self) -> WeightsEffect:
        """A streaming update ended without commit: ``partial`` if it wrote anything. One that wrote
        nothing left the weights ``intact``, also when they were partial before it (they stay so)."""
        if self.state is not WeightState.WRITING:
            return "intact"
        self._to_partial()
        return "partial"

    # -- every update

    def committed(self, names: Iterable[str], *, whole: bool = False) -> WeightsEffect:
        """An update succeeded, writing ``names`` (``whole``: every tensor of the model, as a disk reload does)."""
        self._require(WeightState.SERVING, WeightState.WRITING, WeightState.PARTIAL)
        started_partial = self.state is WeightState.PARTIAL or self._writing_from is WeightState.PARTIAL
        self._writing_from = None
        if whole or not started_partial:
            self._rewritten = None
            self.state = WeightState.SERVING
            return "updated"
        rewritten = self._rewritten if self._rewritten is not None else set()
        rewritten.update(names)
        if self._names <= rewritten:
            self._rewritten = None
            self.state = WeightState.SERVING
            return "updated"
        self._rewritten = rewritten
        self.state = WeightState.PARTIAL
        return "partial"

    def rollback_failed(self) -> WeightsEffect:
        """An atomic apply failed and restoring the previous weights failed too."""
        self._to_partial()
        return "partial"

    def mark_partial(self) -> WeightsEffect:
        """A multi-call update (SGLang's single-phase sync) failed midway: earlier calls may have applied buckets."""
        if self.state is WeightState.RELEASED:
            raise WeightStateError("released weights cannot have been updated")
        self._to_partial()
        return "partial"

    def _to_partial(self) -> None:
        self._writing_from = None
        self._rewritten = set()
        self.state = WeightState.PARTIAL

    # -- memory occupation

    def released(self, *, discarded: bool = False) -> None:
        """Weights released; ``discarded``: without a copy, so after resume no tensor holds real weights
        (``partial`` until updates have rewritten every tensor)."""
        self._require(WeightState.SERVING, WeightState.PARTIAL)
        if discarded:
            self._writing_from = None
            self._rewritten = set()
            self._released_from = WeightState.PARTIAL
        else:
            self._released_from = self.state
        self.state = WeightState.RELEASED

    def resumed(self) -> None:
        self._require(WeightState.RELEASED)
        self.state = self._released_from or WeightState.SERVING
        self._released_from = None
