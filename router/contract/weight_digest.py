"""The one digest of a worker's weights that a trainer can name before an update and the router can read after it.

A caller that knows which weights an update must leave on the workers sends their digest with the
update (``X-Expected-Weights-Checksum``, or ``RouterClient``'s ``expected_checksum``); the router reads
each target's digest after the engines answered and publishes the update's version only if every target
holds those weights. The digest is the engine's own report of the weights it serves, folded into one
string by a rule per engine (:func:`of_checker_answer`), and the trainer computes the same string from
its tensors (``router.trainer.digests``):

- **omni-worker**: ``/weights_checker {"action": "checksum"}``'s checksum of the full tensors
  (``full_checksum``, or rank 0's ``per_gpu_checksum`` without tensor parallelism): SHA-256 over the
  sorted ``name:digest`` lines, each tensor's digest over its name, dtype, shape and bytes (what
  ``sent_checksum`` computes). Every rank must report the same one.
- **SGLang**: the same route; one rank's ``per_gpu_checksum`` in SGLang's own scheme (a shorter
  per-tensor hash than omni-worker's); with several ranks, each rank hashes only its shards and the
  engine's ``per_engine_checksum`` is the digest (a trainer computes it only for one rank).
- **vLLM**: ``/weight_checker {"action": "checksum"}`` answers SHA-256 per parameter as the engine holds it,
  keyed ``dp{d}:pp{p}:pcp{c}:tp{t}:{name}``; the digest is :func:`vllm_digest` of that map: SHA-256
  over the sorted ``key<TAB>sha256<LF>`` lines.

``X-Expected-Weights-Change: unchanged`` says an update is meant to leave the weights as they were
(a reload of the same checkpoint): with ``--verify-updates changed`` the router then does not refuse
it for changing nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Literal

from router.contract.admin import WeightsCheckerResult
from router.contract.vllm_rl import VllmWeightCheckerResult

#: The digest the caller expects every target to hold after the update.
EXPECTED_CHECKSUM_HEADER = "X-Expected-Weights-Checksum"
#: ``changed`` (the default) or ``unchanged``: whether the update is meant to change the weights.
EXPECTED_CHANGE_HEADER = "X-Expected-Weights-Change"

ExpectedChange = Literal["changed", "unchanged"]
#: The router's ``--verify-updates``: ``off``, or ``changed`` (an update that brings tensors must change them).
VerifyUpdates = Literal["off", "changed"]
#: A digest as the engines write them: hexadecimal, 16 to 128 digits (SHA-256 is 64).
DIGEST = re.compile(r"[0-9a-fA-F]{16,128}")


def vllm_digest(checksums: Mapping[str, str]) -> str:
    """vLLM's per-parameter SHA-256 map folded into one digest (see the module docstring)."""
    lines = "".join(f"{key}\t{checksums[key]}\n" for key in sorted(checksums))
    return hashlib.sha256(lines.encode()).hexdigest()


def of_checker_answer(answer: object) -> str | None:
    """The digest a checker's answer says the worker holds; ``None`` when it says none (or ranks disagree)."""
    if isinstance(answer, VllmWeightCheckerResult):
        return vllm_digest(answer.checksums) if answer.checksums else None
    if isinstance(answer, WeightsCheckerResult):
        per_rank = set(answer.checksums_per_rank())
        if len(per_rank) == 1:
            return per_rank.pop().lower()
        if answer.ranks and len(answer.ranks) > 1 and answer.per_engine_checksum:
            return answer.per_engine_checksum.lower()
    return None
