"""ModelWorker: the model, its tokenizer and the state of its weights.

Everything that changes weights runs on the scheduler thread (between forward
steps); the only method safe on other threads is :meth:`ModelWorker.stage_checkpoint`,
which reads a checkpoint into host memory and validates it without touching
the model, so a disk update's I/O does not stall inference.

The weights' state is :attr:`ModelWorker.ledger` (:mod:`worker.engine.weight_state`).
:meth:`ModelWorker.apply_atomic` is the one all-or-nothing write every atomic
update uses (a disk reload, an atomic or single-phase distributed update): it
backs up exactly the tensors it overwrites, so a failure half-way through the
copy restores the previous weights bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from router.dataplane.buckets import NamedTensors
from worker.engine.checker import WeightsChecker
from worker.engine.results import CheckerReport
from worker.engine.weight_state import WeightLedger, WeightState
from worker.model import (
    CausalLM,
    ModelConfig,
    ModelConfigError,
    SeqInput,
    WeightLoadError,
    checkpoint_files,
    load_model,
    load_tokenizer,
    rank_checksum,
    tensor_digest,
)
from worker.model.chat_template import ChatTemplateSlot
from worker.model.checkpoint import check_config_file, read_checkpoint_chunked
from worker.model.kv_cache import KVCache
from worker.model.lora import LoadedLora
from worker.model.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)


class ForwardPeers(Protocol):
    """The follower ranks every forward step of rank 0 is mirrored to (:class:`worker.tp.peers.TPPeers`):
    the engine drives them through this port and never imports the transport."""

    def open_sequence(self, capacity: int) -> int: ...

    def drop_sequence(self, seq: int) -> None: ...

    def send_forward(self, batch: list[tuple[int, list[int], LoadedLora | None]]) -> None: ...

    def await_forward(self) -> None: ...


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# Config fields that decide tensor shapes or the math; a checkpoint that
# differs in any of them cannot be hot-loaded into the running model.
_COMPAT_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "rope_theta",
    "rms_norm_eps",
)


class WeightUpdateError(ValueError):
    """A weight update that was refused or failed; the previous weights are in place."""


class RollbackFailed(RuntimeError):
    """Restoring the previous weights after a failed write failed too: the weights are partial."""


@dataclass
class StagedCheckpoint:
    """A checkpoint read into host memory and validated against the model."""

    path: str
    load_format: str | None
    tensors: NamedTensors


class ModelWorker:
    """Owns the model, tokenizer and weight bookkeeping of one rank."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        served_model_name: str | None = None,
        tp: TensorParallel | None = None,
        peers: ForwardPeers | None = None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(DTYPES)}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        path = str(Path(model_path))
        self.tp = tp
        self.model: CausalLM = load_model(path, dtype=self.dtype, device=self.device, tp=tp)
        self.peers = peers
        """Rank 0 of a tensor-parallel worker: the follower ranks every forward step is mirrored to."""
        self._seq_ids: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self.config: ModelConfig = self.model.config
        # A set, built once: the scheduler tests every sampled token against it.
        self.eos_token_ids: frozenset[int] = frozenset(self.config.eos_token_ids)
        self.tokenizer = load_tokenizer(path)
        self.chat_template = ChatTemplateSlot(path)
        self.model_path = path
        self.tokenizer_path = path
        self.served_model_name = served_model_name or path
        self.load_format: str | None = None
        self.weight_version = "default"
        self.token_step = 0
        self.ledger = WeightLedger(self.model.checkpoint_spec())
        self.checker = WeightsChecker()
        self._released: set[str] = set()
        self._host_weights: dict[str, torch.Tensor] | None = None

    # -- forward steps (the scheduler's only use of the model) ------------------------
    def new_kv_cache(self, capacity_tokens: int) -> KVCache:
        """A sequence's KV cache; on a tensor-parallel rank 0 every follower opens its own with the next step,
        and drops it when this one is freed."""
        kv = self.model.new_kv_cache(capacity_tokens)
        if self.peers is not None:
            seq = self.peers.open_sequence(capacity_tokens)
            self._seq_ids[kv] = seq
            weakref.finalize(kv, self.peers.drop_sequence, seq)
        return kv

    def forward_batch(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One forward step; on rank 0 of a tensor-parallel worker the followers run it with this rank
        (their shards meet in the model's all-reduces), and their acknowledgements are awaited."""
        if self.peers is None:
            return self.model.forward_batch(seqs)
        self.peers.send_forward([(self._seq_ids[s.kv], s.token_ids, s.adapter) for s in seqs])
        try:
            return self.model.forward_batch(seqs)
        finally:
            # Always collected, so each pipe's next answer belongs to the next message.
            self.peers.await_forward()

    # -- facts ----------------------------------------------------------------------
    @property
    def context_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def released_tags(self) -> frozenset[str]:
        return frozenset(self._released)

    @property
    def weights_released(self) -> bool:
        return self.ledger.state is WeightState.RELEASED

    @property
    def weights_partial(self) -> bool:
        """A mix of versions, or being rewritten bucket by bucket: nothing is generated."""
        return self.ledger.mixed

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def memory_usage(self) -> dict[str, float]:
        gib = float(1 << 30)
        weights = 0 if self.weights_released else self.model.parameter_nbytes()
        return {"weight": weights / gib}

    # -- disk updates -----------------------------------------------------------------
    def stage_checkpoint(
        self, model_path: str, load_format: str | None = None, cancel: threading.Event | None = None
    ) -> StagedCheckpoint:
        """Read and validate a checkpoint without touching the model (any thread).

        Every file it reads must be a regular, non-empty file (a FIFO, a device or a
        ``/proc`` file is refused before anything is read). The bytes are read with
        plain file I/O (:func:`~worker.model.checkpoint.read_checkpoint_chunked`),
        so a hung file system blocks only the calling thread; once ``cancel`` is set
        the read stops at its next chunk. Memory: the checkpoint's tensors (see there).

        Raises :class:`WeightUpdateError` with a caller-facing message.
        """
        if load_format not in SUPPORTED_LOAD_FORMATS:
            raise WeightUpdateError(
                f"load_format {load_format!r} is not supported; use one of auto, safetensors or null"
            )
        root = Path(model_path)
        if not root.is_dir():
            raise WeightUpdateError(f"model_path {model_path!r} is not an existing directory")
        if not (root / "config.json").exists():
            raise WeightUpdateError(f"model_path {model_path!r} has no config.json")
        try:
            check_config_file(root)
            checkpoint_files(root)
            new_config = ModelConfig.from_dir(root)
        except (WeightLoadError, ModelConfigError) as exc:
            raise WeightUpdateError(str(exc)) from None
        mismatched = [f for f in _COMPAT_FIELDS if getattr(new_config, f) != getattr(self.config, f)]
        if mismatched:
            detail = ", ".join(f"{f}: {getattr(new_config, f)!r} != {getattr(self.config, f)!r}" for f in mismatched)
            raise WeightUpdateError(f"checkpoint at {model_path!r} does not match the served model ({detail})")
        try:
            tensors = read_checkpoint_chunked(root, self.dtype, cancel=cancel)
            self.model.validate_weights(tensors, require_complete=True)
        except WeightLoadError as exc:
            raise WeightUpdateError(str(exc)) from None
        except (OSError, RuntimeError, ValueError) as exc:
            raise WeightUpdateError(f"cannot read checkpoint at {model_path!r}: {exc}") from None
        return StagedCheckpoint(path=str(root), load_format=load_format, tensors=tensors)

    def apply_atomic(self, named: NamedTensors, *, require_complete: bool = False) -> int:
        """Write ``named`` in one go (scheduler thread only); the previous weights come back on any failure.

        Raises :class:`WeightUpdateError` when the write failed and the backup was
        restored, :class:`RollbackFailed` when restoring failed too.
        """
        if self.weights_released:
            raise WeightUpdateError("weights are released; call /resume_memory_occupation before updating them")
        # Weights that are already a mix (a failed update, or released without a copy) are not worth
        # a copy: a failed write leaves them partial, with every tensor to be rewritten again.
        keep_backup = self.ledger.state is not WeightState.PARTIAL
        views = dict(self.model.iter_checkpoint_tensors()) if keep_backup else {}
        backup = [(views[name], views[name].to("cpu", copy=True)) for name, _ in named if name in views]
        try:
            count = self.model.load_weights(named, require_complete=require_complete)
            self.synchronize()
        except Exception as exc:
            if not keep_backup:
                self.ledger.rollback_failed()
                raise RollbackFailed(
                    f"writing partial weights failed, every tensor must be rewritten: {type(exc).__name__}: {exc}"
                ) from exc
            self._restore(backup)
            if isinstance(exc, WeightLoadError):
                raise WeightUpdateError(str(exc)) from None
            raise WeightUpdateError(
                f"loading weights failed, previous weights restored: {type(exc).__name__}: {exc}"
            ) from None
        return count

    def apply_streamed(self, named: NamedTensors) -> int:
        """Write one streamed bucket (scheduler thread only); its views are not kept."""
        self.ledger.begin_writing()
        count = self.model.load_weights(named)
        self.synchronize()  # the receive thread reuses the buffer as soon as this returns
        return count

    def _restore(self, backup: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                for view, old in backup:
                    view.copy_(old)
            self.synchronize()
        except Exception as exc:
            log.exception("restoring weights after a failed update failed; weights are partial")
            self.ledger.rollback_failed()
            raise RollbackFailed(f"restoring the previous weights failed: {type(exc).__name__}: {exc}") from exc

    # -- memory occupation --------------------------------------------------------------
    def release_memory(self, tags: Iterable[str], *, keep_weights: bool = True) -> list[str]:
        """Free the device storage of released weights, keeping a host copy unless ``keep_weights`` is
        false (then only their shapes are kept, and resume allocates storage that holds no weights)."""
        if "weights" in tags and self.ledger.state is WeightState.WRITING:
            raise WeightUpdateError(
                "a weight update is writing the weights; complete or abort it before releasing them"
            )
        done = []
        for tag in tags:
            if tag in self._released or tag == "cuda_graph":
                continue
            if tag == "weights":
                host: dict[str, torch.Tensor] = {}
                with torch.no_grad():
                    for name, param in self.model.named_parameters():
                        if keep_weights:
                            # On a CPU device the parameter storage already is host memory.
                            host[name] = param.data if param.device.type == "cpu" else param.data.to("cpu")
                        else:
                            host[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                self._host_weights = host
                self.ledger.released(discarded=not keep_weights)
            self._released.add(tag)
            done.append(tag)
        self.empty_device_cache()
        return done

    def resume_memory(self, tags: Iterable[str]) -> list[str]:
        """Restore released weights from the host copy, bit for bit; weights released without a copy get
        zeroed storage instead (the ledger keeps them ``partial`` until updates rewrite every tensor)."""
        done = []
        for tag in tags:
            if tag not in self._released:
                continue
            if tag == "weights":
                host = self._host_weights or {}
                with torch.no_grad():
                    for name, param in self.model.named_parameters():
                        saved = host[name]
                        if saved.is_meta:  # released without a copy: fresh storage, no weights in it
                            param.data = torch.zeros(saved.shape, dtype=saved.dtype, device=self.device)
                        else:
                            param.data = saved if self.device.type == "cpu" else saved.to(self.device)
                self._host_weights = None
                self.synchronize()
                self.ledger.resumed()
            self._released.discard(tag)
            done.append(tag)
        return done

    # -- checker ------------------------------------------------------------------------
    def run_checker(self, action: str, skip: Iterable[str] = ()) -> CheckerReport:
        """The checker over this rank's tensors (its shards at TP > 1); with tensor parallelism also
        ``full_checksum``, over the full checkpoint tensors (every rank runs this together)."""
        if self.weights_released:
            raise WeightUpdateError("weights are released; call /resume_memory_occupation first")
        skipped = set(skip)
        report = self.checker.run(action, self.model.iter_checkpoint_tensors(), skipped)
        if self.tp is not None and self.tp.size > 1:
            report = dataclasses.replace(report, full_checksum=self._full_checksum(skipped))
        return report

    def weights_checksum(self) -> str:
        """The checksum of the full checkpoint tensors this rank serves, in the trainer's scheme
        (``sent_checksum``); at TP > 1 every rank computes it together."""
        if self.tp is not None and self.tp.size > 1:
            return self._full_checksum(set())
        return rank_checksum({name: tensor_digest(name, t) for name, t in self.model.iter_checkpoint_tensors()})

    def _full_checksum(self, skip: set[str]) -> str:
        """Every full checkpoint tensor rebuilt from the ranks' shards (one all-gather each, in the same
        order on every rank), digested in the trainer's scheme."""
        assert self.tp is not None
        specs = self.model.shard_specs()
        digests = {}
        for name, shard in self.model.iter_checkpoint_tensors():
            if name in skip:
                continue
            full = specs[name].full_tensor(self.tp.all_gather(shard))
            digests[name] = tensor_digest(name, full)
        return rank_checksum(digests)

    # -- device helpers -----------------------------------------------------------------
    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
