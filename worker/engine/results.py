"""Typed outcomes of the operations that run on a rank's scheduler thread.

An operation returns ``OpResult[T]``: success, a message, and a payload ``T``,
one small slotted dataclass per kind of step (:class:`Taken`, :class:`Applied`,
:class:`Committed`, ...). Payloads cross the thread boundary and, for the
follower ranks of a tensor-parallel worker, the process boundary (pickled), so
they hold plain values only.

Invariants:

- A payload's field is read by attribute, never by a string key; the one place a
  payload becomes a ``dict`` is :func:`wire_fields`, at the JSON edge (a field's
  ``wire`` name, ``weights`` for an ``effect``, is the key it has in the answer; a
  payload with a ``to_wire`` method, such as :class:`CheckerReport`, shapes its own).
- **A missing effect is ``partial``** (:func:`effect_of`): a rank that answered
  without saying what it did to the weights (it raised, or was lost) may have
  written some of them. This is the contract's own rule (a worker that does not say
  is treated as ``partial``), so the worker and the router read silence alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.contract.admin import WeightsEffect

T = TypeVar("T")

_WEIGHTS = {"wire": "weights"}
_OMIT_NONE = {"omit_none": True}


@dataclass(slots=True)
class OpResult(Generic[T]):
    """One rank's outcome; ``data`` is the operation's typed payload (``None`` when it has none,
    or when the operation raised before producing one)."""

    success: bool
    message: str
    data: T | None = None


def wire_fields(payload: object) -> dict[str, object]:
    """The JSON edge: a payload's fields under their wire names (``{}`` for ``None``).

    A field marked ``omit_none`` is left out while it is ``None``; a payload with its own
    ``to_wire`` (a report whose keys depend on what it holds) is asked for them."""
    if payload is None:
        return {}
    if isinstance(payload, CheckerReport):
        return payload.to_wire()
    out: dict[str, object] = {}
    for f in dataclasses.fields(payload):  # type: ignore[arg-type]
        value = getattr(payload, f.name)
        if value is not None or not f.metadata.get("omit_none"):
            out[f.metadata.get("wire", f.name)] = value
    return out


# -- weight-update steps (worker.engine.weight_ops) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class Checked:
    """``check``: the update may start (or why not); nothing changed either way."""

    num_paused_requests: int
    effect: WeightsEffect = field(default="intact", metadata=_WEIGHTS)


@dataclass(frozen=True, slots=True)
class Taken:
    """``take``: the requests aborted for the update, and whether it paused generation."""

    aborted_rids: list[str] = field(default_factory=list)
    paused_by_update: bool = False
    effect: WeightsEffect = field(default="intact", metadata=_WEIGHTS)


@dataclass(frozen=True, slots=True)
class Applied:
    """An apply step (atomic, or a follower's bucket): what it left the weights as."""

    effect: WeightsEffect = field(metadata=_WEIGHTS)
    num_aborted: int | None = field(default=None, metadata=_OMIT_NONE)
    count: int | None = field(default=None, metadata={"wire": "applied", "omit_none": True})
    """Tensors written (a follower's streamed bucket)."""


@dataclass(slots=True)
class Committed:
    """``commit``: the weights' effect and version, the pause state after it, and the checksum if asked.

    ``num_aborted`` and ``model_path`` are filled in by the caller for its answer."""

    effect: WeightsEffect = field(metadata=_WEIGHTS)
    weight_version: str
    checksum: str | None = field(default=None, metadata=_OMIT_NONE)
    is_paused: bool | None = field(default=None, metadata=_OMIT_NONE)
    num_paused_requests: int | None = field(default=None, metadata=_OMIT_NONE)
    num_aborted: int | None = field(default=None, metadata=_OMIT_NONE)
    model_path: str | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True)
class Ended:
    """``fail`` / ``mark_partial``: what an update that will not commit left the weights as."""

    effect: WeightsEffect = field(metadata=_WEIGHTS)
    weights_partial: bool | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True)
class Received:
    """A follower's receive: how many buckets it took in."""

    buckets_received: int


# -- admin operations (worker.engine.admin_ops) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Paused:
    pause_mode: str
    num_aborted: int
    aborted_rids: list[str]
    num_retracted: int
    num_frozen: int


@dataclass(frozen=True, slots=True)
class Continued:
    was_paused: bool


@dataclass(frozen=True, slots=True)
class Aborted:
    """``/abort_request``: SGLang's count."""

    num_aborted: int
    aborted_rids: list[str]


@dataclass(frozen=True, slots=True)
class AbortedRequests:
    """vLLM's ``/abort_requests``: its count is ``aborted``."""

    aborted: int
    aborted_rids: list[str]


@dataclass(frozen=True, slots=True)
class VersionSet:
    new_version: str
    num_aborted: int
    effect: WeightsEffect = field(default="updated", metadata=_WEIGHTS)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A checked tensor's dtype (``float32``: without ``torch.``) and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CheckerDiff:
    """``compare``: the tensors whose digests match the snapshot, differ from it, or are on one side only."""

    matched: list[str]
    missing: list[str]
    unexpected: list[str]
    changed: list[str]

    @property
    def differing(self) -> int:
        """Tensors that are not as snapshotted (changed, missing or unexpected)."""
        return len(self.changed) + len(self.missing) + len(self.unexpected)


@dataclass(frozen=True, slots=True)
class CheckerReport:
    """``weights_checker``: one rank's summary (sglang-omni ``StrictWeightChecker``).

    ``per_gpu_checksum`` is None when the action failed before digesting anything: the
    report then says only which action it was."""

    action: str
    checksums: dict[str, str] = field(default_factory=dict)
    """Tensor name to its digest (over this rank's shard at TP > 1)."""
    tensor_metadata: dict[str, TensorMeta] = field(default_factory=dict)
    per_gpu_checksum: str | None = None
    """The checksum over ``checksums``."""
    diff: CheckerDiff | None = None
    """``compare`` only."""
    elapsed_s: float = 0.0
    full_checksum: str | None = None
    """TP > 1: the checksum of the full checkpoint tensors, rebuilt from every rank's shard."""

    @property
    def tensor_count(self) -> int:
        return len(self.checksums)

    def to_wire(self) -> dict[str, object]:
        """The JSON edge: the summary's fields, in the checker's order (``{"action"}`` alone for a failure)."""
        if self.per_gpu_checksum is None:
            return {"action": self.action}
        out: dict[str, object] = {
            "action": self.action,
            "tensor_count": self.tensor_count,
            "checksums": dict(self.checksums),
            "tensor_metadata": {n: {"dtype": m.dtype, "shape": list(m.shape)} for n, m in self.tensor_metadata.items()},
            "per_gpu_checksum": self.per_gpu_checksum,
        }
        if self.diff is not None:
            out.update(
                matched=self.diff.matched,
                missing=self.diff.missing,
                unexpected=self.diff.unexpected,
                changed=self.diff.changed,
            )
        out["elapsed_s"] = self.elapsed_s
        if self.full_checksum is not None:
            out["full_checksum"] = self.full_checksum
        return out


@dataclass(frozen=True, slots=True)
class Released:
    released: list[str]


@dataclass(frozen=True, slots=True)
class Resumed:
    resumed: list[str]


@dataclass(frozen=True, slots=True)
class Answered:
    """An answer the coordinator builds itself (a refusal, a failed update, nothing to do)."""

    num_paused_requests: int
    effect: WeightsEffect | None = field(default=None, metadata={"wire": "weights", "omit_none": True})
    num_aborted: int | None = field(default=None, metadata=_OMIT_NONE)
    resumed: list[str] | None = field(default=None, metadata=_OMIT_NONE)
    model_path: str | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One rank as ``/model_info`` reports it."""

    model_path: str | None
    weight_version: str | None
    is_paused: bool
    pause_mode: str | None
    weights_partial: bool
    weights_released: bool
    device: str | None
    dtype: str | None
    alive: bool


def effect_of(data: object) -> WeightsEffect:
    """What a step's payload says it did to the weights; ``partial`` when it says nothing (see the module)."""
    if isinstance(data, (Checked, Taken, Applied, Committed, Ended, VersionSet)):
        return data.effect
    if isinstance(data, Answered) and data.effect is not None:
        return data.effect
    return "partial"
