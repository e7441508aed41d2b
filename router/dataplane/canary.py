"""Byte-exact receives over gloo: slack after every posted receive, and canaries around its end.

gloo frames its messages but does not hold a receive to the size it was posted
with: a message *shorter* than the posted buffer completes as a success (the
rest of the buffer keeps whatever it held), and one *longer* makes gloo's I/O
thread abort the whole process. So a gloo receive posts a ``uint8`` view of the
announced bytes plus :data:`RECEIVE_SLACK_BYTES`, and before posting writes two
canaries (:func:`arm`): 8 bytes at the end of the announced region and 8 at the
start of the slack. After the receive (:func:`check`), an intact end canary
means the message was short, an overwritten slack canary that it was long.

Limits, all documented where the formats use this:

* A message longer than the announced bytes plus the slack still aborts the
  process inside gloo; nothing in Python runs before that.
* A message short by fewer bytes than the end canary (1 to 7) overwrites part of
  it and cannot be told from data that happens to end like the canary: the
  bucket checksum, when the trainer sends one, catches it. Likewise a message
  long by ``k < 8`` bytes whose extra bytes equal the canary's first ``k`` goes
  unseen (probability ``2**-8k``).
* NCCL needs equal counts on every rank (a larger posted buffer would hang), so
  NCCL receives are exact and unguarded: :func:`receive_slack` is 0 there.

Every receiver of one broadcast writes the *same* canary bytes. gloo's
broadcast is a binomial tree: with four or more ranks some receivers relay
their whole posted buffer, canaries and slack included, to other receivers. A
relayed buffer carries the relaying rank's verdict only if both ranks armed the
same bytes. So the canaries are not drawn per process but derived from what
every receiver of a group shares: the group's name and the number of receives
posted on it so far (all ranks post the same broadcasts in the same order). They
are a keyed hash of that, fresh for every receive and unrelated to any data a
trainer sends, so real bytes match them only by chance (``2**-64``).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from router.dataplane.group import WeightUpdateGroup

#: Bytes posted past each broadcast's announced bytes on gloo: a message up to this much
#: longer than announced is received and reported instead of aborting the process.
RECEIVE_SLACK_BYTES = 64 * 1024
#: Length of each canary (the end one is shorter for a broadcast of fewer bytes).
CANARY_BYTES = 8

Verdict = Literal["fewer", "more"]
_PERSON = b"omni-canary"  # separates these hashes from any other use of blake2b


def receive_slack(group: WeightUpdateGroup) -> int:
    """The slack a receive on ``group`` posts: :data:`RECEIVE_SLACK_BYTES` on gloo, 0 on NCCL
    (its counts must match on every rank)."""
    return 0 if group.backend == "nccl" else RECEIVE_SLACK_BYTES


class ByteMismatch(Exception):
    """Broadcasts of one bucket carried a different number of bytes than announced.

    Both sides completed the same broadcasts, so the group is still in lockstep
    and stays usable; only this update fails. ``problems`` holds ``(tensor, verdict)``
    per mismatched broadcast (``tensor`` is ``None`` for a bucket sent as one broadcast).
    """

    def __init__(self, problems: Sequence[tuple[str | None, Verdict]]):
        super().__init__(describe(problems, "this bucket"))
        self.problems = list(problems)

    def describe(self, bucket: str) -> str:
        """The message naming ``bucket`` (e.g. ``"bucket 3/73"``)."""
        return describe(self.problems, bucket)


def describe(problems: Sequence[tuple[str | None, Verdict]], bucket: str) -> str:
    """``received fewer/more bytes than announced for <bucket> (tensor ...)``, for the first problem."""
    tensor, verdict = problems[0]
    what = f"received {verdict} bytes than announced for {bucket}"
    if tensor is not None:
        what += f" (tensor {tensor!r})"
    if len(problems) > 1:
        what += f" and {len(problems) - 1} more tensor(s) of it"
    return what + ": the trainer's broadcast does not match the metadata it sent"


@dataclass(frozen=True, slots=True)
class Armed:
    """The canaries written into one posted receive (offsets within its view)."""

    nbytes: int
    """The announced bytes; the slack starts here."""
    end: bytes
    """Written at ``[nbytes - len(end), nbytes)`` (empty for a broadcast of 0 bytes)."""
    slack: bytes
    """Written at ``[nbytes, nbytes + len(slack))``."""


class CanarySequence:
    """Canary bytes for successive receives on one group, equal on every receiver of it."""

    def __init__(self, name: str):
        self._name = name.encode()
        self._count: Iterator[int] = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> bytes:
        """The ``2 * CANARY_BYTES`` bytes of the next receive (end canary, then slack canary)."""
        with self._lock:
            seq = next(self._count)
        return hashlib.blake2b(
            self._name + b"\0" + seq.to_bytes(8, "little"), digest_size=2 * CANARY_BYTES, person=_PERSON
        ).digest()


_SEQUENCES: weakref.WeakKeyDictionary[WeightUpdateGroup, CanarySequence] = weakref.WeakKeyDictionary()
_SEQUENCES_LOCK = threading.Lock()


def sequence_for(group: WeightUpdateGroup) -> CanarySequence:
    """The canary sequence of ``group``: it starts with the group, as on every other receiver."""
    with _SEQUENCES_LOCK:
        seq = _SEQUENCES.get(group)
        if seq is None:
            seq = _SEQUENCES[group] = CanarySequence(group.name)
        return seq


def arm(view: torch.Tensor, nbytes: int, canary: bytes) -> Armed:
    """Write ``canary`` into ``view`` (1-D ``uint8``, at least ``nbytes + CANARY_BYTES`` long):
    its first half over the last ``min(8, nbytes)`` announced bytes, its second half at the
    start of the slack. Call right before posting the receive into ``view``."""
    end_len = min(CANARY_BYTES, nbytes)
    armed = Armed(nbytes=nbytes, end=canary[CANARY_BYTES - end_len : CANARY_BYTES], slack=canary[CANARY_BYTES:])
    _write(view, nbytes - end_len, armed.end + armed.slack)
    return armed


def check(view: torch.Tensor, armed: Armed) -> Verdict | None:
    """After the receive into ``view``: ``"fewer"`` if the end canary is still whole, ``"more"``
    if the slack canary was overwritten, else ``None`` (exactly the announced bytes)."""
    start = armed.nbytes - len(armed.end)
    got = _read(view, start, len(armed.end) + len(armed.slack))
    if got[len(armed.end) :] != armed.slack:
        return "more"
    if armed.end and got[: len(armed.end)] == armed.end:
        return "fewer"
    return None


def _write(view: torch.Tensor, start: int, data: bytes) -> None:
    view[start : start + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _read(view: torch.Tensor, start: int, length: int) -> bytes:
    region = view[start : start + length]
    return (region if region.device.type == "cpu" else region.cpu()).numpy().tobytes()
