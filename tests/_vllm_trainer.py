"""A trainer process speaking vLLM's weight-transfer API to the router (used by test_router_vllm).

    python -m tests._vllm_trainer CONFIG_JSON

Rank 0 of a gloo group built through the router's ``/init_weight_transfer_engine``, with
``world_size = 1 + GET /get_world_size`` as a vLLM trainer computes it. Each ``/update_weights``
call is posted on a thread while this process broadcasts with :mod:`router.trainer.vllm_sender`,
as vLLM's HTTP trainers do. Scenarios:

- ``sync``: ``/pause``, ``/start_weight_update``, two ``/update_weights`` covering every tensor of
  ``model`` (the first half one broadcast per tensor, the rest packed in small buffers),
  ``/finish_weight_update`` with ``version``;
- ``mismatch``: start, then one packed ``/update_weights`` whose buffers the trainer sends in
  another size than it announced (the receive must fail, not hang), then a finish;
- ``client_sync``: the whole flow through :class:`~router.trainer.client.RouterClient` (init, pause,
  start, the two updates, a finish naming the digest of the tensors sent, the fleet's version), then
  a second sync of ``other_model`` whose finish names the first tensors' digest: a
  :class:`~router.trainer.calls.RouterCallError` (its status, message and typed answer reported).

Writes a JSON report: every call's status and answer, and the send's error if it failed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from router.contract.base import WireResponse
from router.contract.fleet_answers import WeightTransferFleetAnswer
from router.contract.vllm import WeightTransferInitInfo
from router.trainer import RouterCallError, RouterClient, vllm_sender
from router.trainer.digests import expected_checksum
from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from tests._router_fixtures import ADMIN_KEY, auth
from tests.procs import http_json
from worker.model.checkpoint import read_checkpoint

GROUP_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 30.0
#: The longest any one HTTP call may take here (every call the router makes is bounded below it).
CALL_TIMEOUT_S = 120.0

R = TypeVar("R")
A = TypeVar("A", bound=WireResponse)
Named = list[tuple[str, torch.Tensor]]


class Trainer:
    def __init__(self, cfg: dict[str, Any]):
        self.url = cfg["router"]
        self.headers = auth(cfg.get("admin_key", ADMIN_KEY))
        self.report: dict[str, Any] = {"calls": []}
        self.sender: TrainerWeightSender | None = None
        self.port = cfg["port"]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, answer = http_json(method, self.url + path, body, headers=self.headers, timeout=CALL_TIMEOUT_S)
        self.report["calls"].append({"path": path, "status": status, "body": answer})
        return status, answer

    def init(self) -> None:
        status, body = self.call("GET", "/get_world_size")
        assert status == 200, body
        info = self.group_info(body["world_size"])
        status, body = self.join_beside(
            lambda: self.call(
                "POST", "/init_weight_transfer_engine", {"init_info": info.model_dump(mode="json", exclude_unset=True)}
            )
        )
        assert status == 200, body

    def group_info(self, worker_ranks: int) -> WeightTransferInitInfo:
        """This trainer's sender for a group of ``1 + worker_ranks``, and the ``init_info`` announcing it."""
        world_size = 1 + worker_ranks
        self.sender = TrainerWeightSender(
            master_port=self.port, world_size=world_size, group_name="weight_transfer", timeout_s=GROUP_TIMEOUT_S
        )
        return WeightTransferInitInfo(
            master_address="127.0.0.1", master_port=self.port, rank_offset=1, world_size=world_size, timeout_s=60
        )

    def join_beside(self, init: Callable[[], R]) -> R:
        """``init`` (the call that makes the workers join) in flight while this process joins as rank 0."""
        assert self.sender is not None
        return alongside(init, self.sender.join, timeout_s=CALL_TIMEOUT_S, what="init")

    def update(
        self,
        named: Named,
        *,
        send_buffer: int | None = None,
        send_timeout_s: float = 30,
        **info: Any,
    ) -> tuple[int, Any]:
        """``/update_weights`` on a thread while this process broadcasts (in buffers of ``send_buffer``
        bytes when given, else as announced)."""
        return self.send_beside(
            named,
            lambda announce: self.call("POST", "/update_weights", {"update_info": announce}),
            send_buffer=send_buffer,
            send_timeout_s=send_timeout_s,
            **info,
        )

    def send_beside(
        self,
        named: Named,
        post: Callable[[dict[str, Any]], R],
        *,
        send_buffer: int | None = None,
        send_timeout_s: float = 30,
        **info: Any,
    ) -> R:
        """``post(update_info)`` on a thread while this process broadcasts ``named``; ``post``'s value."""
        announce = vllm_sender.update_info(named, **info)
        assert self.sender is not None and self.sender.group is not None
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(post, announce)
            try:
                vllm_sender.send(
                    self.sender.group,
                    named,
                    packed=announce["packed"],
                    packed_buffer_size_bytes=send_buffer or announce["packed_buffer_size_bytes"],
                    timeout_s=send_timeout_s,
                )
            except Exception as exc:
                self.report["send_error"] = f"{type(exc).__name__}: {exc}"
            return call.result(timeout=CALL_TIMEOUT_S + 30)

    def typed(self, path: str, send: Callable[[], A]) -> A | None:
        """One :class:`RouterClient` call, reported like :meth:`call`: its typed answer as JSON (a 2xx, which
        these routes answer as 200), or the :class:`RouterCallError`'s status, message and typed answer
        (``None`` returned then)."""
        try:
            answer = send()
        except RouterCallError as exc:
            failed = exc.answer
            self.report["calls"].append(
                {
                    "path": path,
                    "status": exc.status,
                    "body": {
                        "message": exc.message,
                        "answer_type": type(failed).__name__ if failed is not None else None,
                        "answer": failed.model_dump(mode="json") if failed is not None else None,
                    },
                }
            )
            return None
        self.report["calls"].append({"path": path, "status": 200, "body": answer.model_dump(mode="json")})
        return answer

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def sync(trainer: Trainer, named: Named, version: str) -> None:
    half = len(named) // 2
    trainer.call("POST", "/pause?mode=abort")
    trainer.call("GET", "/is_paused")
    trainer.call("POST", "/start_weight_update", {"timeout_s": 120})
    trainer.update(named[:half])
    trainer.update(named[half:], packed=True, packed_buffer_size_bytes=64 * 1024)
    trainer.call("POST", "/finish_weight_update", {"weight_version": version})


#: The mismatched send's bound: the workers refuse the first buffer within milliseconds, and the
#: trainer's broadcast, which nobody takes any more, waits this long before it fails.
MISMATCH_SEND_TIMEOUT_S = 3.0


def mismatch(trainer: Trainer, named: Named) -> None:
    trainer.call("POST", "/start_weight_update", {"timeout_s": 60})
    trainer.update(
        named,
        packed=True,
        packed_buffer_size_bytes=256 * 1024,
        send_buffer=32 * 1024,
        send_timeout_s=MISMATCH_SEND_TIMEOUT_S,
    )
    trainer.call("POST", "/finish_weight_update", {"weight_version": "never"})


class ClientTrainer:
    """The vLLM flow through :class:`RouterClient`: typed requests and answers, the digest on the finish."""

    def __init__(self, trainer: Trainer, admin_key: str):
        self.trainer = trainer
        self.client = RouterClient(trainer.url, admin_key=admin_key)

    def init(self) -> None:
        t, client = self.trainer, self.client
        info = t.group_info(client.get_world_size().world_size)
        answer = t.join_beside(
            lambda: t.typed("/init_weight_transfer_engine", lambda: client.init_weight_transfer_engine(info))
        )
        assert answer is not None and answer.success, t.report

    def update(self, named: Named, **info: Any) -> WeightTransferFleetAnswer | None:
        """``RouterClient.update_weights`` on a thread while :func:`vllm_sender.send` broadcasts ``named``."""
        t = self.trainer
        return t.send_beside(
            named, lambda announce: t.typed("/update_weights", lambda: self.client.update_weights(announce)), **info
        )

    def sync(self, named: Named, version: str, expected: str) -> WeightTransferFleetAnswer | None:
        """One whole sync of ``named``, its finish naming the digest ``expected``; the finish's answer."""
        t, client = self.trainer, self.client
        t.typed("/pause", lambda: client.pause("abort"))
        t.typed("/is_paused", client.is_paused)
        t.typed("/start_weight_update", lambda: client.start_weight_update(timeout_s=120))
        half = len(named) // 2
        self.update(named[:half])
        self.update(named[half:], packed=True, packed_buffer_size_bytes=64 * 1024)
        return t.typed(
            "/finish_weight_update",
            lambda: client.finish_weight_update(version, expected_checksum=expected),
        )


def client_sync(trainer: Trainer, cfg: dict[str, Any], named: Named) -> None:
    """A sync proven by the digest of the tensors sent, then one whose finish names other tensors' digest."""
    ours = ClientTrainer(trainer, cfg.get("admin_key", ADMIN_KEY))
    ours.init()
    digest = expected_checksum(named, "omni")
    if ours.sync(named, cfg["version"], digest) is not None:
        trainer.typed("/get_weight_version", ours.client.get_weight_version)
    other = sorted(read_checkpoint(cfg["other_model"], torch.float32))
    ours.sync(other, cfg["wrong_version"], digest)  # the workers serve ``other``: its digest is not ``digest``


def main(cfg: dict[str, Any]) -> None:
    named = sorted(read_checkpoint(cfg["model"], torch.float32))
    trainer = Trainer(cfg)
    try:
        if cfg["scenario"] == "client_sync":
            client_sync(trainer, cfg, named)
        elif cfg["scenario"] == "sync":
            trainer.init()
            sync(trainer, named, cfg["version"])
        else:
            trainer.init()
            mismatch(trainer, named)
    finally:
        trainer.close()
        Path(cfg["out"]).write_text(json.dumps(trainer.report))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
