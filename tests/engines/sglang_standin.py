"""A stand-in SGLang 0.5.23 server for the engine tier: SGLang's own server, with only its scheduler replaced.

SGLang has no CPU build, so a real SGLang server cannot run here. This module runs SGLang 0.5.23's own
``launch_server`` (``sglang/srt/entrypoints/http_server.py``) unchanged: its FastAPI app and route code, its
``auth_level`` decorators and API-key middleware, its ``TokenizerManager`` (pause/continue, the
``model_update_lock``, the parked ``/health`` probe, ``meta_info``, weight-version spans, the OpenAI routes),
its real detokenizer process and its startup warmup. ``launch_server`` takes the scheduler process as a
parameter (``run_scheduler_process_func``); this module passes :func:`run_standin_scheduler`, a process that
answers SGLang's scheduler messages (``sglang.srt.managers.io_struct``) over SGLang's own ZMQ channels instead of
running a model. So every answer body, status and content type comes from SGLang's code; only what the
scheduler would have computed is the stand-in's:

- generation is a deterministic toy: output token ``i`` is derived from the prompt's ids, ``i`` and the
  current weight version (never a special token), one token per ``--standin-step-ms`` step; the finish
  reasons, aborts, retractions, streaming cadence and weight-version events follow SGLang's scheduler
  (``managers/scheduler.py``, ``managers/scheduler_components/output_streamer.py``);
- weights are the safetensors files at the current model path: ``/update_weights_from_disk`` checks that the
  path holds some and records it; ``/weights_checker`` hashes each stored tensor with SGLang's own
  ``tensor_hash`` (its CPU path) and ``overall_checksum``, so the values are keyed by checkpoint names and are
  not what a GPU SGLang reports (its names are its fused parameters, sharded per TP rank, and its GPU hash
  differs); every TP rank reports the whole checkpoint;
- there is no process group: ``/init_weights_update_group`` answers SGLang's failure shape, and the
  distributed, tensor and IPC updates answer SGLang's failures for a server with no group or no model;
- ``--tp-size N`` starts N scheduler processes as SGLang does; rank 0 answers for all of them;
- LoRA adapters (``--enable-lora``) are a table, as SGLang's ``LoRAManager`` keeps one: a load from a path
  records it when the path holds a PEFT ``adapter_config.json`` whose rank fits ``--max-lora-rank`` and whose
  name is not loaded yet, and refuses otherwise with SGLang's messages; a load from tensors records the name
  with SGLang's ``__tensor__`` path without reading the tensors; an unload drops it. Every answer is SGLang's
  ``LoRAUpdateOutput`` with the table's names and paths. No adapter changes what the toy generation produces.

Run it as ``python -m tests.engines.sglang_standin --model-path DIR --port P [any ``sglang serve`` flag]``,
plus ``--standin-step-ms MS`` (the decode step, default 10). ``--device cpu`` and ``--host 127.0.0.1`` are
the defaults; it serves loopback only. ``SGLANG_HEALTH_CHECK_TIMEOUT`` (SGLang's own, whole seconds) bounds a
parked ``/health``. :mod:`tests.engines._sglang_standin` starts one for a test.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types


def _install_torchvision_stub() -> None:
    """STUB, not SGLang: an empty ``torchvision`` so that SGLang's server imports without it.

    ``sglang/srt/configs/__init__.py`` imports every model config at import time, and two of them import
    torchvision at module level for image preprocessing (``configs/deepseek_ocr.py:7-8`` and, through
    ``multimodal/internvl_utils.py:5-7``, ``configs/nano_nemotron_vl.py``): ``torchvision.transforms``,
    ``torchvision.transforms.functional`` and ``InterpolationMode``. No route serving a text model calls
    them. The engine tier's environment has no torchvision: the only one PyPI has for this torch is a
    CUDA build that fails to import with a CPU torch. Installed only where torchvision is absent, and only
    after ``transformers`` has cached that it is absent, so ``transformers`` never takes the stub for the
    real package. Any other attribute raises.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    probe = getattr(import_utils, "is_torchvision_available", None)
    if probe is not None:
        probe()  # cached (lru_cache) as False before the stub exists

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name, "Stub installed by tests/engines/sglang_standin.py (torchvision is absent).")
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []

        def missing(attr: str) -> object:
            raise AttributeError(f"{name}.{attr}: torchvision is not installed (sglang stand-in stub)")

        mod.__getattr__ = missing  # type: ignore[method-assign]
        sys.modules[name] = mod
        return mod

    root, transforms, functional = (
        module("torchvision"),
        module("torchvision.transforms"),
        module("torchvision.transforms.functional"),
    )
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]


_install_torchvision_stub()

# SGLang itself, imported only after the stub above is in place.
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from http import HTTPStatus  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from safetensors import safe_open  # noqa: E402
from sglang.srt.constants import GPU_MEMORY_ALL_TYPES  # noqa: E402
from sglang.srt.entrypoints.http_server import launch_server  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers import io_struct as io  # noqa: E402
from sglang.srt.managers.mm_utils import tensor_hash  # noqa: E402
from sglang.srt.managers.schedule_batch import (  # noqa: E402
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_TOKEN,
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
)
from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper  # noqa: E402
from sglang.srt.managers.scheduler_components.memory_usage import build_memory_usage  # noqa: E402
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper  # noqa: E402
from sglang.srt.managers.utils import is_health_check_generate_req  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout  # noqa: E402
from sglang.srt.observability.startup_time import build_scheduler_startup_time  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, get_context, publish, spawn_world_rank  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs, compute_world_size, prepare_server_args  # noqa: E402
from sglang.srt.utils import configure_logger  # noqa: E402
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins  # noqa: E402
from sglang.srt.utils.network import get_zmq_socket  # noqa: E402
from sglang.srt.utils.weight_checker import overall_checksum  # noqa: E402
from sglang.srt.utils.weight_versions import (  # noqa: E402
    WeightVersionEvent,
    compute_weight_version_spans,
    record_weight_version_events,
)

logger = logging.getLogger("sglang_standin")

#: The decode step when ``--standin-step-ms`` is not given; read by the scheduler processes from the environment.
STEP_ENV = "OMNI_SGLANG_STANDIN_STEP_MS"
DEFAULT_STEP_MS = 10.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: How long an idle scheduler waits for a message before its housekeeping (parent check, deferred flush).
IDLE_POLL_MS = 100
#: The KV capacity the stand-in reports (SGLang's ``max_total_num_tokens``).
TOKEN_CAPACITY = 65536


def _json_or_none(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int)}
    return set()


@dataclasses.dataclass
class _ModelFacts:
    """What the stand-in scheduler needs from a checkpoint's ``config.json``."""

    vocab_size: int
    context_len: int
    special_ids: frozenset[int]

    @classmethod
    def read(cls, model_path: str) -> _ModelFacts:
        config = _json_or_none(Path(model_path) / "config.json")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        assert isinstance(text, dict)
        vocab = int(text.get("vocab_size") or 32000)
        context = int(text.get("max_position_embeddings") or 4096)
        special = _ids(text.get("eos_token_id")) | _ids(text.get("bos_token_id")) | _ids(text.get("pad_token_id"))
        return cls(vocab_size=vocab, context_len=context, special_ids=frozenset(special))


def _checkpoint_tensors(model_path: str) -> list[Path]:
    root = Path(model_path)
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def _checkpoint_checksums(model_path: str, skip: list[str] | None) -> dict[str, str]:
    """SGLang's per-tensor checksum (``utils/weight_checker.py`` ``_hash_tensor``: ``tensor_hash`` as 16 hex
    digits) of every tensor stored at ``model_path``, by checkpoint name; SGLang's skip patterns apply."""
    skipped = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu", *(skip or ()))
    checksums: dict[str, str] = {}
    for file in _checkpoint_tensors(model_path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if any(pattern in name for pattern in skipped):
                    continue
                tensor: torch.Tensor = handle.get_tensor(name)
                checksums[name] = f"{tensor_hash(tensor):016x}"
    return checksums


@dataclasses.dataclass(eq=False)
class _Req:
    """One generation request as the stand-in scheduler tracks it (the fields of SGLang's ``Req`` it uses)."""

    obj: io.TokenizedGenerateReqInput
    prompt_digest: bytes
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    to_finish: dict[str, Any] | None = None
    send_token_offset: int = 0
    send_decode_id_offset: int = 0
    surr_offset: int | None = None
    read_offset: int | None = None
    surr_and_decode_ids: list[int] = dataclasses.field(default_factory=list)
    cur_decode_ids_len: int = 0
    input_logprob_sent: bool = False
    send_logprob_offset: int = 0
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    retraction_count: int = 0
    weight_version_events: list[WeightVersionEvent] = dataclasses.field(default_factory=list)

    @property
    def rid(self) -> str:
        assert self.obj.rid is not None
        return self.obj.rid

    @property
    def input_ids(self) -> list[int]:
        return list(self.obj.input_ids or [])

    def finished(self) -> bool:
        return self.finished_reason is not None

    def incremental_detokenize(self) -> tuple[list[int], int]:
        """SGLang's ``Req.init_incremental_detokenize`` (``managers/schedule_batch.py:1788-1806``)."""
        if self.surr_offset is None or self.read_offset is None:
            self.read_offset = len(self.input_ids)
            self.surr_offset = max(self.read_offset - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
            self.surr_and_decode_ids = self.input_ids[self.surr_offset :] + self.output_ids
        else:
            self.surr_and_decode_ids.extend(self.output_ids[self.cur_decode_ids_len :])
        self.cur_decode_ids_len = len(self.output_ids)
        return self.surr_and_decode_ids, self.read_offset - self.surr_offset


def _logprob(seed: bytes) -> float:
    """A deterministic log-probability in (-10, 0) from ``seed``."""
    return -(int.from_bytes(hashlib.sha256(seed).digest()[:4], "big") % 10000) / 1000.0 - 0.001


class StandinScheduler:
    """Answers SGLang's scheduler messages on SGLang's ZMQ channels (TP rank 0 of the stand-in).

    The message → answer table follows ``Scheduler._request_dispatcher`` (``managers/scheduler.py:1828-1933``):
    a control request gets its ``*ReqOutput`` on the tokenizer channel, generation results go as
    ``BatchTokenIDOutput`` to SGLang's detokenizer, aborted waiting requests come back as ``AbortReq``.
    """

    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tp_size: int) -> None:
        begin = time.perf_counter()
        self.server_args = server_args
        self.tp_size = tp_size
        self.step_s = float(os.environ.get(STEP_ENV, DEFAULT_STEP_MS)) / 1000.0
        self.model_path = str(server_args.model_path)
        self.weight_version = str(server_args.weight_version)
        self.facts = _ModelFacts.read(self.model_path)
        self.stream_interval = int(server_args.stream_interval or 1)
        self.force_stream_interval = int(envs.SGLANG_FORCE_STREAM_INTERVAL.get())
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.engine_paused = False
        self.health_ipcs: deque[str | None] = deque()
        self.session_open = False
        self.session_loaded = False
        self.snapshot: dict[str, str] | None = None
        self.reset_tensors = False
        self.released: set[str] = set()
        self.forward_sleep_s: float | None = None
        self.last_gen_throughput = 0.0
        self.open_sessions: set[str] = set()
        self.loras: dict[str, tuple[str, str]] = {}
        """The loaded LoRA adapters: SGLang's ``lora_id`` → (name, path), as ``LoRAManager.lora_refs``."""

        context = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.send_to_tokenizer = SenderWrapper(get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False))
        self.send_to_detokenizer = SenderWrapper(
            get_zmq_socket(context, zmq.PUSH, port_args.detokenizer_ipc_name, False)
        )
        self.flush_wrapper = SchedulerFlushWrapper(
            flush_cache=self.flush_cache, is_fully_idle=self.is_fully_idle, send_output=self.send_control_output
        )
        self._checksum_cache: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
        load_begin = time.perf_counter()
        self.checksums_of(self.model_path)  # read the checkpoint once, as SGLang loads it at startup
        self.startup_time = build_scheduler_startup_time(
            target_load_weight=time.perf_counter() - load_begin,
            draft_load_weight=0.0,
            kv_cache_allocation=0.0,
            scheduler_e2e=time.perf_counter() - begin,
            target_cuda_graph=None,
            draft_cuda_graph=None,
        )
        self.handlers: dict[type, Any] = {
            io.TokenizedGenerateReqInput: self.handle_generate_request,
            io.BatchTokenizedGenerateReqInput: self.handle_batch_generate_request,
            io.FlushCacheReqInput: self.flush_wrapper.handle,
            io.AbortReq: self.abort_request,
            io.UpdateWeightFromDiskReqInput: self.update_weights_from_disk,
            io.InitWeightsUpdateGroupReqInput: self.init_weights_update_group,
            io.DestroyWeightsUpdateGroupReqInput: self.destroy_weights_update_group,
            io.BeginWeightUpdateReqInput: self.begin_weight_update,
            io.EndWeightUpdateReqInput: self.end_weight_update,
            io.UpdateWeightsFromDistributedReqInput: self.update_weights_from_distributed,
            io.UpdateWeightsFromTensorReqInput: self.update_weights_from_tensor,
            io.UpdateWeightsFromIPCReqInput: self.update_weights_from_ipc,
            io.UpdateWeightVersionReqInput: self.update_weight_version,
            io.GetWeightsByNameReqInput: self.get_weights_by_name,
            io.ReleaseMemoryOccupationReqInput: self.release_memory_occupation,
            io.ResumeMemoryOccupationReqInput: self.resume_memory_occupation,
            io.CheckWeightsReqInput: self.check_weights,
            io.SlowDownReqInput: self.slow_down,
            io.PauseGenerationReqInput: self.pause_generation,
            io.ContinueGenerationReqInput: self.continue_generation,
            io.GetInternalStateReq: self.get_internal_state,
            io.SetInternalStateReq: lambda req: io.SetInternalStateReqOutput(updated=False),
            io.OpenSessionReqInput: self.open_session,
            io.CloseSessionReqInput: self.close_session,
            io.LoadLoRAAdapterReqInput: self.load_lora_adapter,
            io.LoadLoRAAdapterFromTensorsReqInput: self.load_lora_adapter_from_tensors,
            io.UnloadLoRAAdapterReqInput: self.unload_lora_adapter,
            io.FreezeGCReq: lambda req: None,
            io.ConfigureLoggingReq: lambda req: None,
            io.ProfileReq: lambda req: io.ProfileReqOutput(
                success=False, message="The SGLang stand-in has no profiler."
            ),
        }

    # ------------------------------------------------------------------ init info and the loop

    def init_info(self) -> dict[str, Any]:
        """What ``Scheduler.get_init_info`` sends to the launcher (``managers/scheduler.py:1935-1960``)."""
        return {
            "status": "ready",
            "max_total_num_tokens": TOKEN_CAPACITY,
            "max_req_input_len": self.facts.context_len - 1,
            "startup_time": self.startup_time,
            "hicache_object_layout": disabled_l3_layout("Hierarchical cache is disabled", page_size=1),
        }

    def run(self) -> None:
        parent = psutil.Process().parent()
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        next_parent_check = time.monotonic() + 1.0
        next_step = time.monotonic()
        while True:
            busy = bool(self.running or self.waiting) and not self.engine_paused
            timeout_ms = max(0.0, (next_step - time.monotonic()) * 1000.0) if busy else IDLE_POLL_MS
            if poller.poll(timeout_ms):
                self.ingest()
            self.flush_wrapper.check_pending()
            now = time.monotonic()
            if not self.engine_paused and now >= next_step:
                if self.running or self.waiting:
                    self.step()
                    next_step = now + self.step_s + (self.forward_sleep_s or 0.0)
                else:
                    next_step = now
                self.maybe_send_health_check_signal()
            if now >= next_parent_check:
                next_parent_check = now + 1.0
                if parent is None or not parent.is_running():
                    logger.info("The SGLang server process is gone; the stand-in scheduler exits.")
                    return

    def ingest(self) -> None:
        while True:
            try:
                recv_req = io.sock_recv(self.recv_from_tokenizer, zmq.NOBLOCK)
            except zmq.Again:
                return
            if is_health_check_generate_req(recv_req) and not self.is_fully_idle(for_health_check=True):
                # SGLang answers a health probe on a busy server with a HealthCheckOutput after the next batch.
                self.health_ipcs.append(getattr(recv_req, "http_worker_ipc", None))
                continue
            handler = self.handlers.get(type(recv_req))
            if handler is None:
                logger.warning("The SGLang stand-in does not handle %s; it is ignored.", type(recv_req).__name__)
                continue
            output = handler(recv_req)
            if output is not None:
                self.send_control_output(output, recv_req)

    def send_control_output(self, output: Any, recv_req: Any) -> None:
        self.send_to_tokenizer.send_output(output, recv_req)

    def maybe_send_health_check_signal(self) -> None:
        if self.health_ipcs:
            self.send_to_tokenizer.send_output(io.HealthCheckOutput(http_worker_ipc=self.health_ipcs.popleft()))

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        idle = not self.running
        if not ignore_waiting:
            idle = idle and not self.waiting
        return idle

    # ------------------------------------------------------------------ generation

    def handle_generate_request(self, recv_req: io.TokenizedGenerateReqInput) -> None:
        input_ids = list(recv_req.input_ids or [])
        digest = hashlib.sha256(",".join(map(str, input_ids)).encode()).digest()
        req = _Req(obj=recv_req, prompt_digest=digest)
        start = recv_req.logprob_start_len
        if not recv_req.return_logprob:
            start = -1
        if start > len(input_ids):
            message = (
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(input_ids)}. Please use a smaller logprob_start_len."
            )
            req.to_finish = FINISH_ABORT(message, HTTPStatus.BAD_REQUEST, "BadRequestError").to_json()
        self.waiting.append(req)

    def handle_batch_generate_request(self, recv_req: io.BatchTokenizedGenerateReqInput) -> None:
        for item in recv_req:
            if is_health_check_generate_req(item) and not self.is_fully_idle(for_health_check=True):
                self.health_ipcs.append(item.http_worker_ipc)
                continue
            self.handle_generate_request(item)

    def _logprob_start(self, req: _Req) -> int:
        """``Scheduler.handle_generate_request``'s ``logprob_start_len`` (``managers/scheduler.py:3256-3273``)."""
        obj = req.obj
        if not obj.return_logprob:
            return -1
        if obj.logprob_start_len == -1:
            return len(req.input_ids) if obj.token_ids_logprob is None else -1
        return int(obj.logprob_start_len)

    def _next_token(self, req: _Req) -> int:
        position = len(req.output_ids)
        seed = req.prompt_digest + f"|{self.weight_version}|{position}".encode()
        token = int.from_bytes(hashlib.sha256(seed).digest()[:4], "big") % self.facts.vocab_size
        while token in self.facts.special_ids:
            token = (token + 1) % self.facts.vocab_size
        return token

    def step(self) -> None:
        """One scheduler iteration: admit the waiting requests (prefill), then one decode step for all."""
        if self.waiting:
            self.running.extend(self.waiting)
            self.waiting = []
        for req in self.running:
            sampling = req.obj.sampling_params
            token = self._next_token(req)
            req.output_ids.append(token)
            req.output_logprobs.append(_logprob(req.prompt_digest + f"|{token}|{len(req.output_ids)}".encode()))
            if req.to_finish is not None:
                req.finished_reason, req.to_finish = req.to_finish, None
            elif sampling.stop_token_ids and token in sampling.stop_token_ids:
                req.finished_reason = FINISH_MATCHED_TOKEN(matched=token).to_json()
            elif sampling.max_new_tokens is not None and len(req.output_ids) >= sampling.max_new_tokens:
                req.finished_reason = FINISH_LENGTH(length=sampling.max_new_tokens).to_json()
        self.last_gen_throughput = len(self.running) / max(self.step_s, 1e-3)
        self.stream_output(self.running)
        self.running = [req for req in self.running if not req.finished()]

    def stream_output(self, reqs: list[_Req]) -> None:
        """``BatchTokenIDOutput`` for the requests due (``scheduler_components/output_streamer.py:444-801``)."""
        due = [req for req in reqs if self._should_output(req)]
        if not due:
            return
        out: dict[str, list[Any]] = {key: [] for key in _BATCH_LIST_FIELDS}
        any_logprob = any(req.obj.return_logprob for req in due)
        for req in due:
            send_offset = req.send_token_offset
            out["rids"].append(req.rid)
            out["http_worker_ipcs"].append(req.obj.http_worker_ipc)
            out["finished_reasons"].append(req.finished_reason)
            out["output_ids"].append(req.output_ids[send_offset:])
            req.send_token_offset = len(req.output_ids)
            out["prompt_tokens"].append(len(req.input_ids))
            out["reasoning_tokens"].append(0)
            out["cached_tokens"].append(0)
            out["decoded_texts"].append("")
            decode_ids, read_offset = req.incremental_detokenize()
            out["decode_ids"].append(decode_ids[req.send_decode_id_offset :])
            req.send_decode_id_offset = len(decode_ids)
            out["read_offsets"].append(read_offset)
            out["skip_special_tokens"].append(req.obj.sampling_params.skip_special_tokens)
            out["spaces_between_special_tokens"].append(req.obj.sampling_params.spaces_between_special_tokens)
            out["no_stop_trim"].append(req.obj.sampling_params.no_stop_trim)
            out["completion_tokens"].append(len(req.output_ids))
            out["cached_tokens_details"].append(None)
            out["image_tokens"].append(0)
            out["audio_tokens"].append(0)
            out["video_tokens"].append(0)
            out["retraction_counts"].append(req.retraction_count)
            out["weight_versions"].append(
                compute_weight_version_spans(
                    req.weight_version_events,
                    current_version=self.weight_version,
                    num_output_tokens=len(req.output_ids),
                )
                if req.finished()
                else None
            )
            if any_logprob:
                self._append_logprobs(out, req)
        payload = io.BatchTokenIDOutput(
            rids=out["rids"],
            http_worker_ipcs=out["http_worker_ipcs"],
            finished_reasons=out["finished_reasons"],
            decoded_texts=out["decoded_texts"],
            decode_ids=out["decode_ids"],
            read_offsets=out["read_offsets"],
            output_ids=out["output_ids"],
            skip_special_tokens=out["skip_special_tokens"],
            spaces_between_special_tokens=out["spaces_between_special_tokens"],
            no_stop_trim=out["no_stop_trim"],
            prompt_tokens=out["prompt_tokens"],
            reasoning_tokens=out["reasoning_tokens"],
            completion_tokens=out["completion_tokens"],
            cached_tokens=out["cached_tokens"],
            cached_tokens_details=out["cached_tokens_details"],
            image_tokens=out["image_tokens"],
            audio_tokens=out["audio_tokens"],
            video_tokens=out["video_tokens"],
            input_token_logprobs_val=out["input_token_logprobs_val"],
            input_token_logprobs_idx=out["input_token_logprobs_idx"],
            output_token_logprobs_val=out["output_token_logprobs_val"],
            output_token_logprobs_idx=out["output_token_logprobs_idx"],
            input_top_logprobs_val=out["input_top_logprobs_val"],
            input_top_logprobs_idx=out["input_top_logprobs_idx"],
            output_top_logprobs_val=out["output_top_logprobs_val"],
            output_top_logprobs_idx=out["output_top_logprobs_idx"],
            input_token_ids_logprobs_val=out["input_token_ids_logprobs_val"],
            input_token_ids_logprobs_idx=out["input_token_ids_logprobs_idx"],
            output_token_ids_logprobs_val=out["output_token_ids_logprobs_val"],
            output_token_ids_logprobs_idx=out["output_token_ids_logprobs_idx"],
            output_token_entropy_val=None,
            output_token_sampling_mask=[],
            output_hidden_states=[],
            routed_experts=[],
            indexer_topk=[],
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
            retraction_counts=out["retraction_counts"],
            weight_versions=out["weight_versions"] if any(out["weight_versions"]) else None,
            time_stats=None,  # SGLang's per-request scheduler timings; the stand-in has none
            dp_ranks=[0] * len(due),
        )
        self.send_to_detokenizer.send_output(payload)

    def _should_output(self, req: _Req) -> bool:
        if req.finished():
            return True
        unsent = len(req.output_ids) - req.send_token_offset
        if req.obj.stream:
            interval = req.obj.sampling_params.stream_interval or self.stream_interval
            return interval == 1 or unsent >= interval or (req.send_token_offset == 0 and unsent > 0)
        return len(req.output_ids) % self.force_stream_interval == 0

    def _append_logprobs(self, out: dict[str, list[Any]], req: _Req) -> None:
        obj = req.obj
        top_k = max(int(obj.top_logprobs_num or 0), 0)
        extra_ids = list(obj.token_ids_logprob or [])
        vocab = self.facts.vocab_size

        def top(token: int, value: float) -> tuple[list[float], list[int]]:
            return [value - j for j in range(top_k)], [(token + j) % vocab for j in range(top_k)]

        def by_id(seed: bytes) -> list[float]:
            return [_logprob(seed + f"|id{token}".encode()) for token in extra_ids]

        start = self._logprob_start(req)
        if obj.return_logprob and not req.input_logprob_sent and start >= 0:
            ids = req.input_ids[start:]
            # SGLang's input logprobs start with None for the first position (logprob_result_processor.py:38).
            scored = [_logprob(req.prompt_digest + f"|in{start + i}".encode()) for i in range(1, len(ids))]
            out["input_token_logprobs_val"].append([None, *scored] if ids else [])
            out["input_token_logprobs_idx"].append(ids)
            tops = [top(t, v) for t, v in zip(ids[1:], scored, strict=True)]
            out["input_top_logprobs_val"].append(([None] + [t[0] for t in tops]) if top_k and ids else [])
            out["input_top_logprobs_idx"].append(([None] + [t[1] for t in tops]) if top_k and ids else [])
            out["input_token_ids_logprobs_val"].append(
                [by_id(req.prompt_digest + f"|in{start + i}".encode()) for i in range(len(ids))] if extra_ids else []
            )
            out["input_token_ids_logprobs_idx"].append([extra_ids for _ in ids] if extra_ids else [])
            req.input_logprob_sent = True
        else:
            for key in (
                "input_token_logprobs_val",
                "input_token_logprobs_idx",
                "input_top_logprobs_val",
                "input_top_logprobs_idx",
                "input_token_ids_logprobs_val",
                "input_token_ids_logprobs_idx",
            ):
                out[key].append([])
        if obj.return_logprob:
            begin, end = req.send_logprob_offset, len(req.output_ids)
            tokens, values_out = req.output_ids[begin:end], req.output_logprobs[begin:end]
            out["output_token_logprobs_val"].append(values_out)
            out["output_token_logprobs_idx"].append(tokens)
            tops_out = [top(t, v) for t, v in zip(tokens, values_out, strict=True)]
            out["output_top_logprobs_val"].append([t[0] for t in tops_out] if top_k else [])
            out["output_top_logprobs_idx"].append([t[1] for t in tops_out] if top_k else [])
            seeds = [req.prompt_digest + f"|out{begin + i}".encode() for i in range(len(tokens))]
            out["output_token_ids_logprobs_val"].append([by_id(s) for s in seeds] if extra_ids else [])
            out["output_token_ids_logprobs_idx"].append([extra_ids for _ in tokens] if extra_ids else [])
            req.send_logprob_offset = end
        else:
            for key in (
                "output_token_logprobs_val",
                "output_token_logprobs_idx",
                "output_top_logprobs_val",
                "output_top_logprobs_idx",
                "output_token_ids_logprobs_val",
                "output_token_ids_logprobs_idx",
            ):
                out[key].append([])

    # ------------------------------------------------------------------ abort, pause, continue

    def abort_request(self, recv_req: io.AbortReq) -> None:
        """``Scheduler.abort_request`` (``managers/scheduler.py:5675-5815``): waiting requests are dropped and
        reported with an ``AbortReq``; running ones finish as aborted after one more step."""

        def matches(req: _Req) -> bool:
            return bool(recv_req.abort_all or (recv_req.rid is not None and req.rid.startswith(recv_req.rid)))

        kept: list[_Req] = []
        for req in self.waiting:
            if not matches(req):
                kept.append(req)
                continue
            abort = io.AbortReq(
                rid=req.rid,
                finished_reason=recv_req.finished_reason,
                weight_versions=compute_weight_version_spans(
                    req.weight_version_events,
                    current_version=self.weight_version,
                    num_output_tokens=len(req.output_ids),
                ),
            )
            self.send_to_tokenizer.send_output(abort, req.obj)
        self.waiting = kept
        for req in self.running:
            if not req.finished() and matches(req):
                if recv_req.abort_message:
                    req.to_finish = FINISH_ABORT(recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE).to_json()
                else:
                    req.to_finish = FINISH_ABORT().to_json()

    def pause_generation(self, recv_req: io.PauseGenerationReqInput) -> None:
        """``Scheduler.pause_generation`` (``managers/scheduler.py:5817-5932``): ``in_place`` keeps the running
        requests where they are; ``retract`` moves them back to the waiting queue."""
        self.engine_paused = True
        if recv_req.mode == "retract":
            for req in self.running:
                if not req.finished():
                    req.retraction_count += 1
                    self.waiting.append(req)
            self.running = []
            self.last_gen_throughput = 0.0

    def continue_generation(self, recv_req: io.ContinueGenerationReqInput) -> None:
        self.engine_paused = False

    # ------------------------------------------------------------------ cache and memory

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """``Scheduler.flush_cache`` (``managers/scheduler.py:5518-5547``): only when idle; a waiting queue is
        tolerated while the engine is paused."""
        if self.is_fully_idle(ignore_waiting=self.engine_paused):
            return True
        logger.warning(
            "Cache not flushed because there are pending requests. #queue-req: %d, #running-req: %d",
            len(self.waiting),
            len(self.running),
        )
        return False

    def release_memory_occupation(
        self, recv_req: io.ReleaseMemoryOccupationReqInput
    ) -> io.ReleaseMemoryOccupationReqOutput:
        """SGLang asserts idleness here (``scheduler_components/weight_updater.py:337-340``); a failed assert
        ends the scheduler process, and the server with it. The stand-in does the same."""
        assert self.is_fully_idle(ignore_waiting=self.engine_paused), (
            "release_memory_occupation should be called only when server is idle."
        )
        self.released.update(recv_req.tags or GPU_MEMORY_ALL_TYPES)
        return io.ReleaseMemoryOccupationReqOutput()

    def resume_memory_occupation(
        self, recv_req: io.ResumeMemoryOccupationReqInput
    ) -> io.ResumeMemoryOccupationReqOutput:
        for tag in recv_req.tags or GPU_MEMORY_ALL_TYPES:
            self.released.remove(tag)  # a KeyError ends the scheduler, as SGLang's set.remove does
        return io.ResumeMemoryOccupationReqOutput()

    def slow_down(self, recv_req: io.SlowDownReqInput) -> io.SlowDownReqOutput:
        self.forward_sleep_s = recv_req.forward_sleep_time
        return io.SlowDownReqOutput()

    # ------------------------------------------------------------------ weights

    def checksums_of(self, model_path: str, skip: list[str] | None = None) -> dict[str, str]:
        key = (model_path, tuple(skip or ()))
        if key not in self._checksum_cache:
            self._checksum_cache[key] = _checkpoint_checksums(model_path, skip)
        return self._checksum_cache[key]

    def record_weight_version_change(self, new_version: str | None) -> None:
        """``Scheduler.record_weight_version_change`` (``managers/scheduler.py:5636-5658``)."""
        if new_version is None or new_version == self.weight_version:
            return
        old_version, self.weight_version = self.weight_version, new_version
        record_weight_version_events([*self.running, *self.waiting], old_version=old_version)

    def flush_after_update(self, flush: bool, success: bool, message: str) -> tuple[bool, str]:
        """``flush_cache_after_weight_update`` (``scheduler_components/weight_updater.py:118-131``)."""
        if flush and not self.flush_cache():
            return False, (
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache."
            )
        return success, message

    def update_weights_from_disk(self, recv_req: io.UpdateWeightFromDiskReqInput) -> io.UpdateWeightFromDiskReqOutput:
        if not _checkpoint_tensors(recv_req.model_path):
            message = f"Failed to get weights iterator: Cannot find any model weights with `{recv_req.model_path}`."
            logger.error(message)
            return io.UpdateWeightFromDiskReqOutput(success=False, message=message, num_paused_requests=0)
        self.model_path = recv_req.model_path
        self.reset_tensors = False
        self.facts = _ModelFacts.read(self.model_path)
        self.record_weight_version_change(recv_req.weight_version)
        success, message = self.flush_after_update(recv_req.flush_cache, True, "Succeeded to update model weights.")
        if not success:
            logger.error(message)
        return io.UpdateWeightFromDiskReqOutput(success=success, message=message, num_paused_requests=0)

    def init_weights_update_group(
        self, recv_req: io.InitWeightsUpdateGroupReqInput
    ) -> io.InitWeightsUpdateGroupReqOutput:
        rank = recv_req.rank_offset  # + this rank's tp_rank, which is 0
        message = (
            "Failed to initialize custom process group: the SGLang stand-in has no model runner to join a "
            f"process group with (group_name={recv_req.group_name}, rank={rank}, world_size={recv_req.world_size}, "
            f"backend={recv_req.backend})."
        )
        logger.error(message)
        return io.InitWeightsUpdateGroupReqOutput(success=False, message=message)

    def destroy_weights_update_group(
        self, recv_req: io.DestroyWeightsUpdateGroupReqInput
    ) -> io.DestroyWeightsUpdateGroupReqOutput:
        return io.DestroyWeightsUpdateGroupReqOutput(success=False, message="The group to be destroyed does not exist.")

    def begin_weight_update(self, recv_req: io.BeginWeightUpdateReqInput) -> io.BeginWeightUpdateReqOutput:
        if self.session_open:
            return io.BeginWeightUpdateReqOutput(
                success=False,
                message="a weight-update session is already open; call end_weight_update() first",
            )
        self.session_open, self.session_loaded = True, False
        return io.BeginWeightUpdateReqOutput(success=True, message="Success")

    def end_weight_update(self, recv_req: io.EndWeightUpdateReqInput) -> io.EndWeightUpdateReqOutput:
        if not self.session_open:
            return io.EndWeightUpdateReqOutput(
                success=False,
                message="no weight-update session is open; call begin_weight_update() first",
            )
        self.session_open = False
        return io.EndWeightUpdateReqOutput(success=True, message="Success")

    def update_weights_from_distributed(
        self, recv_req: io.UpdateWeightsFromDistributedReqInput
    ) -> io.UpdateWeightsFromDistributedReqOutput:
        if not self.session_open:
            message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
        else:
            message = (
                f"Failed to receive weights: group {recv_req.group_name!r} not in "
                "model_update_group; please call `init_weights_update_group` first."
            )
        return io.UpdateWeightsFromDistributedReqOutput(success=False, message=message)

    def update_weights_from_tensor(
        self, recv_req: io.UpdateWeightsFromTensorReqInput
    ) -> io.UpdateWeightsFromTensorReqOutput:
        if not self.session_open:
            message = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        else:
            message = "Failed to update weights from tensor: the SGLang stand-in holds no model to load them into."
        return io.UpdateWeightsFromTensorReqOutput(success=False, message=message)

    def update_weights_from_ipc(self, recv_req: io.UpdateWeightsFromIPCReqInput) -> io.UpdateWeightsFromIPCReqOutput:
        return io.UpdateWeightsFromIPCReqOutput(
            success=False, message="Failed to update weights from IPC: the SGLang stand-in has no CUDA IPC."
        )

    def update_weight_version(self, recv_req: io.UpdateWeightVersionReqInput) -> io.UpdateWeightVersionReqOutput:
        self.record_weight_version_change(recv_req.new_version)
        return io.UpdateWeightVersionReqOutput()

    def get_weights_by_name(self, recv_req: io.GetWeightsByNameReqInput) -> io.GetWeightsByNameReqOutput:
        for file in _checkpoint_tensors(self.model_path):
            with safe_open(str(file), framework="pt") as handle:
                if recv_req.name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = handle.get_tensor(recv_req.name).float()
                    rows = tensor if tensor.dim() > 1 else tensor.unsqueeze(0)
                    values = rows[:, : recv_req.truncate_size].tolist() if tensor.dim() > 1 else rows[0].tolist()
                    return io.GetWeightsByNameReqOutput(parameter=values[: recv_req.truncate_size])
        return io.GetWeightsByNameReqOutput(parameter=None)

    def check_weights(self, recv_req: io.CheckWeightsReqInput) -> io.CheckWeightsReqOutput:
        """``SchedulerWeightUpdaterManager.check_weights`` (``scheduler_components/weight_updater.py:424-456``)
        over the checkpoint's tensors; ``reset_tensors`` marks every tensor changed until the next update."""
        try:
            current = self.checksums_of(self.model_path, recv_req.skip_tensor_list)
            if self.reset_tensors:
                current = {name: f"{(int(value, 16) ^ 0xFFFFFFFFFFFFFFFF):016x}" for name, value in current.items()}
            if recv_req.action == "snapshot":
                self.snapshot = dict(current)
                return io.CheckWeightsReqOutput(success=True, message="Success.")
            if recv_req.action == "reset_tensors":
                self.reset_tensors = True
                return io.CheckWeightsReqOutput(success=True, message="Success.")
            if recv_req.action == "compare":
                assert self.snapshot is not None
                differing = sorted(name for name, value in current.items() if self.snapshot.get(name) != value)
                self.snapshot = None
                if differing:
                    raise Exception("check tensor equality failed:\n" + "\n".join(f"name={n}" for n in differing))
                return io.CheckWeightsReqOutput(success=True, message="Success.")
            if recv_req.action != "checksum":
                raise Exception(f"Unsupported action={recv_req.action!r}")
            per_gpu = overall_checksum(current)
            ranks = [
                io.ChecksumInfo(
                    checksums=dict(current),
                    per_gpu_checksum=per_gpu,
                    parallelism_info=[
                        io.ParallelismInfo(
                            role="target",
                            tp_rank=tp_rank,
                            tp_size=self.tp_size,
                            dp_rank=0,
                            dp_size=1,
                            pp_rank=0,
                            pp_size=1,
                            rank=tp_rank,
                            size=self.tp_size,
                        )
                    ],
                )
                for tp_rank in range(self.tp_size)
            ]
            return io.CheckWeightsReqOutput(success=True, message="Success.", payload=ranks)
        except Exception as e:
            logger.warning("check_weights see error: %s", e)
            return io.CheckWeightsReqOutput(success=False, message=f"{e}")

    # ------------------------------------------------------------------ state and sessions

    # ------------------------------------------------------------------ LoRA adapters (a table; no tensors)

    def lora_result(self, success: bool, error_message: str = "") -> io.LoRAUpdateOutput:
        """``LoRAManager.create_lora_update_result`` (``lora/lora_manager.py:267-277``)."""
        loaded = dict(self.loras.values())
        return io.LoRAUpdateOutput(success=success, error_message=error_message, loaded_adapters=loaded)

    def lora_refusal(self, name: str, path: str) -> str | None:
        """Why SGLang would refuse to load ``name`` from ``path`` here: ``LoRAConfig`` reading the PEFT config
        (``lora/lora_config.py``) and ``validate_new_adapter`` (``lora/lora_manager.py:337-375``)."""
        config_path = Path(path) / "adapter_config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            return f"Can't find or read adapter_config.json at {path!r}: {e}"
        if any(loaded == name for loaded, _ in self.loras.values()):
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        max_rank = getattr(self.server_args, "max_lora_rank", None)
        if max_rank is not None and int(config.get("r", 0)) > max_rank:
            return (
                f"LoRA adapter {name} with rank {config.get('r')} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        return None

    def load_lora_adapter(self, recv_req: io.LoadLoRAAdapterReqInput) -> io.LoRAUpdateOutput:
        refusal = self.lora_refusal(recv_req.lora_name, recv_req.lora_path)
        if refusal is not None:
            return self.lora_result(False, refusal)
        assert recv_req.lora_id is not None  # the tokenizer manager names every load
        self.loras[recv_req.lora_id] = (recv_req.lora_name, recv_req.lora_path)
        return self.lora_result(True)

    def load_lora_adapter_from_tensors(self, recv_req: io.LoadLoRAAdapterFromTensorsReqInput) -> io.LoRAUpdateOutput:
        if any(loaded == recv_req.lora_name for loaded, _ in self.loras.values()):
            return self.lora_result(
                False, f"Failed to load LoRA adapter {recv_req.lora_name} because it is already loaded"
            )
        assert recv_req.lora_id is not None
        self.loras[recv_req.lora_id] = (recv_req.lora_name, "__tensor__")
        return self.lora_result(True)

    def unload_lora_adapter(self, recv_req: io.UnloadLoRAAdapterReqInput) -> io.LoRAUpdateOutput:
        # SGLang's tokenizer manager refuses an unknown name before it gets here; its scheduler drops the id.
        self.loras.pop(str(recv_req.lora_id), None)
        return self.lora_result(True)

    def get_internal_state(self, recv_req: io.GetInternalStateReq) -> io.GetInternalStateReqOutput:
        """The fields of ``SchedulerInternalState.get_internal_state`` (``scheduler_components/internal_state.py``)
        that a model-free scheduler can fill."""
        state = get_context().resolved_server_args_dict()
        state["world_size"] = compute_world_size(dp_size=1, tp_size=self.tp_size, pp_size=1)
        state["startup_time"] = self.startup_time
        state["effective_max_running_requests_per_dp"] = self.server_args.max_running_requests or 4096
        state["last_gen_throughput"] = self.last_gen_throughput
        state["memory_usage"] = build_memory_usage(
            weight_gb=0.0,
            kv_cache_gb=0.0,
            startup_available_gb=0.0,
            token_capacity=TOKEN_CAPACITY,
            token_capacity_swa=None,
            target_graph_memory_usage=None,
            draft_graph_memory_usage=None,
        )
        state.pop("custom_sigquit_handler", None)
        return io.GetInternalStateReqOutput(internal_state=msgspec_to_builtins(state))

    def open_session(self, recv_req: io.OpenSessionReqInput) -> io.OpenSessionReqOutput:
        session_id = recv_req.session_id or ""
        success = session_id not in self.open_sessions
        self.open_sessions.add(session_id)
        return io.OpenSessionReqOutput(session_id=session_id if success else None, success=success)

    def close_session(self, recv_req: io.CloseSessionReqInput) -> None:
        self.open_sessions.discard(recv_req.session_id)


#: The per-request list fields of ``BatchTokenIDOutput`` that :meth:`StandinScheduler.stream_output` fills.
_BATCH_LIST_FIELDS = (
    "rids",
    "http_worker_ipcs",
    "finished_reasons",
    "decoded_texts",
    "decode_ids",
    "read_offsets",
    "output_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "prompt_tokens",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "image_tokens",
    "audio_tokens",
    "video_tokens",
    "retraction_counts",
    "weight_versions",
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "input_token_ids_logprobs_val",
    "input_token_ids_logprobs_idx",
    "output_token_ids_logprobs_val",
    "output_token_ids_logprobs_idx",
)


def run_standin_scheduler(
    server_args: ServerArgs,
    port_args: PortArgs,
    gpu_id: int,
    tp_rank: int,
    pp_rank: int,
    dp_rank: int | None,
    pipe_writer: Any,
    *_: Any,
    **__: Any,
) -> None:
    """The scheduler process SGLang's launcher starts per TP rank (``run_scheduler_process``'s signature,
    ``managers/scheduler.py:6310``). Rank 0 runs :class:`StandinScheduler`; the other ranks report ready and
    idle until the server process is gone."""
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank), dp_rank=dp_rank, gpu_id=gpu_id
        ),
    )
    configure_logger(server_args, prefix=f" TP{tp_rank}")
    parent = psutil.Process().parent()
    try:
        if tp_rank != 0:
            pipe_writer.send({"status": "ready", "max_total_num_tokens": TOKEN_CAPACITY, "startup_time": {}})
            while parent is not None and parent.is_running():
                time.sleep(1.0)
            return
        scheduler = StandinScheduler(server_args, port_args, tp_size=int(server_args.tp_size))
        pipe_writer.send(scheduler.init_info())
        scheduler.run()
    except Exception:
        # As SGLang's run_scheduler_process does: log, then SIGQUIT the server, which ends the process tree.
        logger.exception("Scheduler hit an exception")
        if parent is not None:
            parent.send_signal(signal.SIGQUIT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.engines.sglang_standin",
        description="SGLang 0.5.23's own server with a stand-in scheduler (takes every `sglang serve` flag).",
    )
    parser.add_argument("--standin-step-ms", type=float, default=DEFAULT_STEP_MS, help="one decode step, in ms")
    own, rest = parser.parse_known_args(argv)
    for flag, default in (("--device", "cpu"), ("--host", "127.0.0.1")):
        if not any(arg == flag or arg.startswith(flag + "=") for arg in rest):
            rest += [flag, default]
    server_args = prepare_server_args(rest)
    if server_args.host not in LOOPBACK_HOSTS:
        parser.error(f"the SGLang stand-in serves loopback only, not {server_args.host!r}")
    if int(server_args.dp_size) != 1 or int(server_args.pp_size) != 1:
        parser.error("the SGLang stand-in supports --dp-size 1 and --pp-size 1 only")
    os.environ[STEP_ENV] = str(own.standin_step_ms)  # the scheduler processes inherit the environment
    launch_server(server_args, run_scheduler_process_func=run_standin_scheduler)


if __name__ == "__main__":
    main()
