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
  another size than it announced (the receive must fail, not hang), then a finish.

Writes a JSON report: every call's status and answer, and the send's error if it failed.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from router.trainer import vllm_sender
from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from tests._router_fixtures import ADMIN_KEY, auth
from tests.procs import http_json
from worker.model.checkpoint import read_checkpoint

GROUP_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 30.0
#: The longest any one HTTP call may take here (every call the router makes is bounded below it).
CALL_TIMEOUT_S = 120.0


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
        world_size = 1 + body["world_size"]
        self.sender = TrainerWeightSender(
            master_port=self.port, world_size=world_size, group_name="weight_transfer", timeout_s=GROUP_TIMEOUT_S
        )
        info = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1, "world_size": world_size}
        status, body = alongside(
            lambda: self.call("POST", "/init_weight_transfer_engine", {"init_info": {**info, "timeout_s": 60}}),
            self.sender.join,
            timeout_s=CALL_TIMEOUT_S,
            what="init",
        )
        assert status == 200, body

    def update(
        self,
        named: list[tuple[str, torch.Tensor]],
        *,
        send_buffer: int | None = None,
        send_timeout_s: float = 30,
        **info: Any,
    ) -> tuple[int, Any]:
        """``/update_weights`` on a thread while this process broadcasts (in buffers of ``send_buffer``
        bytes when given, else as announced)."""
        announce = vllm_sender.update_info(named, **info)
        assert self.sender is not None and self.sender.group is not None
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(self.call, "POST", "/update_weights", {"update_info": announce})
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

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def sync(trainer: Trainer, named: list[tuple[str, torch.Tensor]], version: str) -> None:
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


def mismatch(trainer: Trainer, named: list[tuple[str, torch.Tensor]]) -> None:
    trainer.call("POST", "/start_weight_update", {"timeout_s": 60})
    trainer.update(
        named,
        packed=True,
        packed_buffer_size_bytes=256 * 1024,
        send_buffer=32 * 1024,
        send_timeout_s=MISMATCH_SEND_TIMEOUT_S,
    )
    trainer.call("POST", "/finish_weight_update", {"weight_version": "never"})


def main(cfg: dict[str, Any]) -> None:
    named = sorted(read_checkpoint(cfg["model"], torch.float32))
    trainer = Trainer(cfg)
    try:
        trainer.init()
        if cfg["scenario"] == "sync":
            sync(trainer, named, cfg["version"])
        else:
            mismatch(trainer, named)
    finally:
        trainer.close()
        Path(cfg["out"]).write_text(json.dumps(trainer.report))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
