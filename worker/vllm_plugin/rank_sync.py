"""One vLLM worker rank's side of the two-phase weight sync: its groups and its prepared update.

vLLM calls every method on the rank's main thread (``collective_rpc``), one at a time; only the
receive (a ``BucketReceiver`` thread) and the expiry run beside it. The rules are omni-worker's:

* **Refuse before receiving.** Names, dtypes and shapes are checked against the served checkpoint
  (:mod:`worker.transfer.validation`) and the update must cover every checkpoint tensor
  (:func:`~worker.vllm_plugin.spec.missing_names`) before a receive is posted; a refused prepare
  posts nothing, so the trainer never broadcasts into the void.
* **Always staged.** Every bucket is held until complete, verified against its announced checksum,
  and only then handed to vLLM's loader (``apply``), so any failure before the apply leaves the old
  weights untouched (``weights: "intact"``). A streaming request (``atomic: false``) is served the
  same way: vLLM cannot load part of a layer in place while generation could run.
* **Every wait is bounded**: the join, the receive, complete's wait; a prepared update nobody
  completes or aborts ends by itself after its window, the loop's grace and one apply.
* **Abort** drops the prepared receive; a broadcast already posted cannot be withdrawn, so if the
  receive was still waiting the group is marked broken until it is destroyed and joined again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from router.contract.budget import APPLY_S, DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateRequest,
    CompleteWeightsUpdateResponse,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    WeightSyncResponse,
)
from router.dataplane.buckets import NamedTensors
from router.dataplane.digest import digest_named_tensors
from router.dataplane.formats import for_load_format
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from worker.transfer.group.receive_session import RECEIVE_GRACE_S
from worker.transfer.group.receiver import BucketReceiver
from worker.transfer.group.table import group_note
from worker.transfer.group.two_phase import ABORTED
from worker.transfer.validation import ChecksumMismatch, MetadataError, Spec, validate_buckets, verify_staged
from worker.vllm_plugin.spec import missing_names

#: Loads checkpoint-named full tensors into the served model (vLLM's in-place reload).
Apply = Callable[[NamedTensors], None]


@dataclass(eq=False)
class Prepared:
    """The update between a ready prepare and its complete, abort or expiry."""

    group: WeightUpdateGroup
    receiver: BucketReceiver
    checksums: tuple[str | None, ...]
    weight_version: str | None
    deadline: float
    started: float = field(default_factory=time.monotonic)
    expiry: threading.Timer | None = None

    def wait_s(self) -> float:
        """To the receive's deadline, plus the grace the loop gets to report."""
        return max(self.deadline - time.monotonic(), 0.0) + RECEIVE_GRACE_S


@dataclass
class RankContext:
    """What a rank needs from vLLM, gathered by the extension (kept out of here so this stays engine-free)."""

    rank: int
    """This rank's index among the server's ranks (``rank_offset + rank`` in the group)."""
    num_ranks: int
    device: torch.device
    spec: Callable[[], Spec]
    is_ignored: Callable[[str], bool]
    apply: Apply


class RankWeightSync:
    """This rank's joined groups and its prepared update (at most one)."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.weights_partial = False
        """A loader failed midway: some layers hold new weights, others old ones."""
        self._prepared: Prepared | None = None
        self._lock = threading.Lock()

    # -- groups --------------------------------------------------------------------------------

    def init_group(self, req: InitWeightsUpdateGroupRequest) -> WeightSyncResponse:
        name, ctx = req.group_name, self.ctx
        if name in self.groups:
            return _group_fail(f"group {name!r} already exists; destroy it first.", join_attempted=False)
        if req.rank_offset + ctx.num_ranks > req.world_size:
            return _group_fail(
                f"this server's {ctx.num_ranks} rank(s) from rank_offset {req.rank_offset} do not fit in "
                f"world_size {req.world_size}.",
                join_attempted=False,
            )
        backend = req.backend or ("nccl" if ctx.device.type == "cuda" else "gloo")
        rank = req.rank_offset + ctx.rank
        try:
            self.groups[name] = init_weight_update_group(
                master_address=req.master_address,
                master_port=req.master_port,
                rank=rank,
                world_size=req.world_size,
                group_name=name,
                backend=backend,
                timeout_s=req.timeout_s or DEFAULT_GROUP_TIMEOUT_S,
            )
        except GroupError as exc:
            return _group_fail(f"{exc}.", join_attempted=True)
        return WeightSyncResponse(
            success=True, message=f"Succeeded to initialize custom process group (rank {rank}).", join_attempted=True
        )

    def destroy_group(self, req: DestroyWeightsUpdateGroupRequest) -> WeightSyncResponse:
        group = self.groups.pop(req.group_name, None)
        if group is None:
            return WeightSyncResponse(success=False, message="The group to be destroyed does not exist.")
        with self._lock:
            prepared = self._prepared
            if prepared is not None and prepared.group is group:
                self._drop(prepared, "the weight-update group was destroyed")
        group.destroy()
        return WeightSyncResponse(success=True, message="Succeeded to destroy custom process group.")

    # -- two phase -----------------------------------------------------------------------------

    def prepare(self, req: PrepareWeightsUpdateRequest) -> PrepareWeightsUpdateResponse:
        ctx = self.ctx
        with self._lock:
            current = self._prepared
            if current is not None:
                if not current.receiver.state.finished:
                    return _not_ready("a weight update is already in progress; call /complete_weights_update first")
                self._drop(current, "a new weight update was prepared")  # received, never completed
        group = self.groups.get(req.group_name)
        if group is None:
            return _not_ready(
                f"Process group {req.group_name!r} not initialized; call /init_weights_update_group first"
            )
        if not group.alive:
            return _not_ready(
                f"group {req.group_name!r} is broken ({group.broken_reason}); destroy and re-initialize it"
            )
        fmt = for_load_format(req.load_format)
        try:
            spec = ctx.spec()
            layouts = validate_buckets(req.buckets, spec, flattened=fmt.requires_aligned, is_ignored=ctx.is_ignored)
        except MetadataError as exc:
            return _not_ready(str(exc))
        missing = missing_names(spec, {s.name for layout in layouts for s in layout.slots}, ctx.is_ignored)
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
            return _not_ready(
                f"this server applies complete updates only (vLLM reloads each layer from the tensors it is given), "
                f"but {len(missing)} checkpoint tensor(s) are not in the update: {shown}"
            )
        window = req.timeout_s or DEFAULT_RECEIVE_TIMEOUT_S
        # NCCL receives into device memory; gloo into host memory (also on a GPU server: the loader copies).
        device = ctx.device if group.backend == "nccl" else torch.device("cpu")
        receiver = BucketReceiver(group, layouts, fmt=fmt, apply=None, device=device)
        try:
            receiver.start(window)
        except GroupError as exc:
            return _not_ready(str(exc))
        prepared = Prepared(
            group=group,
            receiver=receiver,
            checksums=tuple(b.checksum for b in req.buckets),
            weight_version=req.weight_version,
            deadline=time.monotonic() + window,
        )
        expiry = threading.Timer(window + RECEIVE_GRACE_S + APPLY_S, self._expire, args=(prepared,))
        expiry.daemon = True
        prepared.expiry = expiry
        with self._lock:
            self._prepared = prepared
        expiry.start()
        served = "atomic" if req.atomic else "streaming requested, served staged: applied at complete"
        return PrepareWeightsUpdateResponse(
            status="ready", message=f"Started recv loop for {req.num_buckets} buckets ({served})", weights="intact"
        )

    def complete(self, req: CompleteWeightsUpdateRequest) -> CompleteWeightsUpdateResponse:
        prepared = self._take(req.group_name)
        if prepared is None:
            return self._failed(f"no weight update was prepared for group {req.group_name!r}")
        wait_s = req.timeout_s if req.timeout_s is not None else prepared.wait_s()
        try:
            outcome = prepared.receiver.wait(wait_s)
            elapsed = time.monotonic() - prepared.started
            if not outcome.ok:
                return self._failed(
                    f"{outcome.error}; previous weights kept.{group_note(prepared.group)}",
                    received=outcome.buckets_received,
                    elapsed_s=elapsed,
                )
            staged = prepared.receiver.staged()
            try:
                verify_staged(staged, prepared.checksums)
            except ChecksumMismatch as exc:
                return self._failed(f"{exc}; previous weights kept", outcome.buckets_received, elapsed)
            named = [t for _, bucket in staged for t in bucket]
            # The bytes handed to vLLM's loader, digested as omni-worker digests its weights (and as
            # the trainer's ``sent_checksum`` digests what it sent).
            checksum = digest_named_tensors(named)[1] if req.return_checksum else None
            try:
                self.ctx.apply(named)
            except Exception as exc:  # vLLM's loader failed midway: some layers may hold new weights
                self.weights_partial = True
                return CompleteWeightsUpdateResponse(
                    success=False,
                    weights="partial",
                    weights_partial=True,
                    num_buckets_received=outcome.buckets_received,
                    elapsed_s=time.monotonic() - prepared.started,
                    message="applying the received weights failed, the weights are partial: "
                    f"{type(exc).__name__}: {exc}",
                )
        finally:
            prepared.receiver.release()
        self.weights_partial = False
        return CompleteWeightsUpdateResponse(
            success=True,
            weights="updated",
            weights_partial=False,
            num_buckets_received=outcome.buckets_received,
            checksum=checksum,
            weight_version=req.weight_version if req.weight_version is not None else prepared.weight_version,
            elapsed_s=time.monotonic() - prepared.started,
            message=f"Applied weights from {outcome.buckets_received} buckets",
        )

    def abort(self, req: AbortWeightsUpdateRequest) -> AbortWeightsUpdateResponse:
        prepared = self._take(req.group_name)
        if prepared is None:
            return AbortWeightsUpdateResponse(
                success=False,
                weights="intact",
                weights_partial=self.weights_partial,
                message=f"no prepared weight update for group {req.group_name!r} to abort",
            )
        prepared.receiver.cancel(ABORTED, broken_reason=ABORTED)
        prepared.receiver.release()
        outcome = prepared.receiver.outcome()
        return AbortWeightsUpdateResponse(
            success=True,
            weights="intact",
            weights_partial=self.weights_partial,
            message=f"Dropped the prepared weight update for group {req.group_name!r} ({outcome.buckets_received} "
            f"of {outcome.buckets_expected} bucket(s) received, none applied); weights unchanged."
            + group_note(prepared.group),
        )

    # -- the prepared update -------------------------------------------------------------------

    def _take(self, group_name: str) -> Prepared | None:
        """Detach the prepared update of ``group_name`` (``None`` when there is none for it)."""
        with self._lock:
            prepared = self._prepared
            if prepared is None or prepared.group.name != group_name:
                return None
            self._prepared = None
        if prepared.expiry is not None:
            prepared.expiry.cancel()
        return prepared

    def _drop(self, prepared: Prepared, reason: str) -> None:
        """Under the lock: fail the prepared update's receive and free its buffers."""
        self._prepared = None
        if prepared.expiry is not None:
            prepared.expiry.cancel()
        prepared.receiver.cancel(reason)
        prepared.receiver.release()

    def _expire(self, prepared: Prepared) -> None:
        with self._lock:
            if self._prepared is prepared:
                self._drop(
                    prepared, "no /complete_weights_update or /abort_weights_update before the update's deadline"
                )

    def _failed(self, message: str, received: int = 0, elapsed_s: float | None = None) -> CompleteWeightsUpdateResponse:
        return CompleteWeightsUpdateResponse(
            success=False,
            weights="intact",
            weights_partial=self.weights_partial,
            num_buckets_received=received,
            elapsed_s=elapsed_s,
            message=message,
        )


def _group_fail(message: str, *, join_attempted: bool) -> WeightSyncResponse:
    return WeightSyncResponse(
        success=False, message=f"Failed to initialize custom process group: {message}", join_attempted=join_attempted
    )


def _not_ready(message: str) -> PrepareWeightsUpdateResponse:
    return PrepareWeightsUpdateResponse(status="error", message=message, weights="intact")
