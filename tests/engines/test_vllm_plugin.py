"""The vLLM plugin (``worker/vllm_plugin``) against a real vLLM server, driven by a real trainer process.

A vLLM server (tensor parallelism 1, then 2) serves checkpoint A with the plugin
(``VLLM_PLUGINS=omni_router`` and the worker extension). A trainer process (this module run as
``python -m tests.engines.test_vllm_plugin CONFIG``, using the project's trainer side:
``TrainerWeightSender``, ``BucketPlan``, ``sent_checksum``) joins the weight-update group as rank 0
and talks to the server directly, no router: it syncs checkpoint B's weights in, and the server's
greedy tokens must then equal ``transformers``' on B, ``/weight_info`` must report the new label,
and complete's checksum must equal the trainer's. Refused prepares (not paused, wrong shape,
unknown name, an incomplete update), a broadcast whose bytes do not match their checksum and an
abort must leave A's tokens served.

Engine tier: runs only with ``OMNI_ENGINE_TIER=1`` in an environment where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines._vllm_server import PLUGIN_ARGS, VllmServer, vllm_server
from tests.engines.conftest import PROMPT, TOKENS
from tests.procs import free_port, http_json

pytestmark = [
    pytest.mark.skipif(os.environ.get("OMNI_ENGINE_TIER") != "1", reason="engine tier: set OMNI_ENGINE_TIER=1"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here"),
    pytest.mark.timeout(900),
]

TRAINER_TIMEOUT_S = 240.0
#: Small buckets, so that a sync of the tiny model still has several of them.
BUCKET_BYTES = 256 * 1024


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request: pytest.FixtureRequest, ckpts: dict[str, Path]) -> Iterator[VllmServer]:
    """One server at a time: every test runs against tensor parallelism 1, then 2 (each rank joins the group)."""
    tp: int = request.param
    env: dict[str, str] = {}
    if tp > 1:
        if _cuda():
            import torch

            if torch.cuda.device_count() < tp:
                pytest.skip(f"tensor parallelism {tp} needs {tp} GPUs")
        else:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < tp:
                pytest.skip(f"tensor parallelism {tp} on CPU needs {tp} cores")
            # vLLM's CPU workers each bind their threads to cores; one NUMA node cannot be split automatically.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tp])
    args = [*PLUGIN_ARGS, "--tensor-parallel-size", str(tp)]
    with vllm_server(ckpts["a"], extra_args=args, env=env) as srv:
        yield srv


def greedy(server: VllmServer) -> list[int]:
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,  # as hf_greedy's min_new_tokens: EOS is masked, not just ignored
        "temperature": 0.0,
        "return_token_ids": True,
    }
    status, answer = http_json("POST", server.url + "/v1/completions", body, timeout=120)
    assert status == 200, answer
    return [int(t) for t in answer["choices"][0]["token_ids"]]


def run_trainer(server: VllmServer, tmp_path: Path, **cfg: Any) -> dict[str, Any]:
    out = tmp_path / f"trainer-{cfg['scenario']}.json"
    config = {"url": server.url, "port": free_port(), "group": "omni_vllm", "timeout_s": 120.0, "out": str(out), **cfg}
    argv = [sys.executable, "-m", "tests.engines.test_vllm_plugin", json.dumps(config)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TRAINER_TIMEOUT_S, check=False)
    assert out.exists(), f"the trainer left no report (rc {done.returncode}):\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert "crash" not in report, f"{report['crash']}\nserver log:\n{server.log_text()}"
    return report


def step(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in report["steps"] if s["step"] == name)


# -- the tests (in this order: refusals first, then the syncs) -----------------------------------


def test_malformed_bodies_are_400_and_reach_no_engine(server: VllmServer) -> None:
    for body in (b"nope", b"[1, 2]", json.dumps({"num_buckets": 1, "group_name": "g"}).encode()):
        status, answer = http_json("POST", server.url + "/prepare_weights_update", raw=body)
        assert status == 400 and answer["error"]["message"], answer
    status, answer = http_json("POST", server.url + "/init_weights_update_group", {"master_port": 1})
    assert status == 400 and "master_address" in answer["error"]["message"], answer


def test_refused_prepares_and_an_abort_keep_the_old_weights(
    server: VllmServer, reference: dict[str, list[int]], ckpts: dict[str, Path], tmp_path: Path
) -> None:
    assert greedy(server) == reference["a"], "vLLM on A must agree with transformers before any sync"
    report = run_trainer(server, tmp_path, scenario="refusals", ckpt=str(ckpts["b"]))
    assert step(report, "init")["status"] == 200, report

    for name, words in [
        ("not paused", "not paused"),
        ("wrong shape", "does not match the model's"),
        ("unknown name", "unknown parameter name"),
        ("incomplete", "not in the update"),
    ]:
        s = step(report, name)
        assert s["status"] == 400, (name, s)
        answer = s["answer"]
        assert answer["status"] == "error" and answer["weights"] == "intact", (name, answer)
        assert words in answer["error"]["message"], (name, answer)

    assert step(report, "prepare bad bytes")["answer"]["status"] == "ready", report
    bad = step(report, "complete bad bytes")
    assert bad["status"] == 400 and not bad["answer"]["success"], bad
    assert bad["answer"]["weights"] == "intact" and "checksum mismatch" in bad["answer"]["error"]["message"], bad
    assert bad["answer"]["num_buckets_received"] == report["num_buckets"], bad

    ready, aborted = step(report, "prepare to abort"), step(report, "abort")
    assert ready["status"] == 200 and ready["answer"]["status"] == "ready", ready
    assert aborted["status"] == 200 and aborted["answer"]["success"], aborted
    assert aborted["answer"]["weights"] == "intact", aborted
    assert step(report, "destroy")["status"] == 200, report

    assert greedy(server) == reference["a"], "a refused or aborted update must leave A's weights served"
    assert http_json("GET", server.url + "/weight_info")[1]["weight_version"] != "refused"


@pytest.mark.parametrize(
    ("target", "fmt", "atomic", "paused", "version"),
    [
        ("b", "flattened_bucket", False, True, "step-1"),  # streaming requested: served staged
        ("a", None, True, False, "step-2"),  # per tensor, atomic, and the server pauses itself
    ],
    ids=["to-b-flattened-streaming-paused", "back-to-a-per-tensor-atomic-abort-all"],
)
def test_two_phase_sync_reaches_vllm(
    server: VllmServer,
    reference: dict[str, list[int]],
    ckpts: dict[str, Path],
    tmp_path: Path,
    target: str,
    fmt: str | None,
    atomic: bool,
    paused: bool,
    version: str,
) -> None:
    report = run_trainer(
        server,
        tmp_path,
        scenario="sync",
        ckpt=str(ckpts[target]),
        format=fmt,
        atomic=atomic,
        pause=paused,
        version=version,
    )
    assert step(report, "init")["status"] == 200, report
    prepare = step(report, "prepare")
    assert prepare["status"] == 200 and prepare["answer"]["status"] == "ready", prepare
    complete = step(report, "complete")
    assert complete["status"] == 200, complete
    answer = complete["answer"]
    assert answer["success"] and answer["weights"] == "updated" and not answer["weights_partial"], answer
    assert answer["num_buckets_received"] == report["num_buckets"] > 1, answer
    assert answer["checksum"] == report["sent_checksum"], "complete's checksum must be the trainer's sent_checksum"
    assert answer["weight_version"] == version, answer
    ranks = http_json("GET", server.url + "/get_world_size?include_dp=false")[1]["world_size"]
    assert [r["success"] for r in answer["rank_results"]] == [True] * ranks, answer
    assert [c["checksum"] for c in answer["rank_checksums"]] == [report["sent_checksum"]] * ranks, answer

    assert http_json("GET", server.url + "/weight_info")[1]["weight_version"] == version
    assert http_json("GET", server.url + "/is_paused")[1]["is_paused"] is False, "the update must end unpaused"
    assert greedy(server) == reference[target], f"vLLM must now generate as transformers does on checkpoint {target}"
    print(f"\nsync to {target} at {ranks} rank(s), {fmt or 'per tensor'}: {report['timings']}")


@pytest.mark.gpu
def test_two_phase_sync_over_nccl(
    server: VllmServer, ckpts: dict[str, Path], reference: dict[str, list[int]], tmp_path: Path
) -> None:
    """The same sync with the trainer's tensors and every rank's buffers on the GPU, over NCCL.

    NCCL refuses two ranks of one group on one GPU, so the trainer takes the GPU after the server's."""
    import torch

    ranks = http_json("GET", server.url + "/get_world_size?include_dp=false")[1]["world_size"]
    if not _cuda() or torch.cuda.device_count() < ranks + 1:
        pytest.skip(f"needs {ranks + 1} CUDA devices (the server's {ranks} and the trainer's)")
    report = run_trainer(
        server,
        tmp_path,
        scenario="sync",
        ckpt=str(ckpts["b"]),
        format="flattened_bucket",
        atomic=True,
        pause=True,
        version="gpu-1",
        backend="nccl",
        device=f"cuda:{ranks}",
    )
    answer = step(report, "complete")["answer"]
    assert answer["success"] and answer["checksum"] == report["sent_checksum"], answer
    assert greedy(server) == reference["b"]


# -- the trainer process -----------------------------------------------------------------------


class _Trainer:
    """Rank 0 of the group, talking to the vLLM server directly (what a hand-written trainer does)."""

    def __init__(self, cfg: dict[str, Any]):
        import torch

        from router.trainer.sender import BucketPlan, TrainerWeightSender
        from worker.model import read_checkpoint

        self.cfg, self.url = cfg, cfg["url"]
        self.report: dict[str, Any] = {"steps": [], "timings": {}}
        device = cfg.get("device", "cpu")
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
        self.tensors = {n: t.to(device) for n, t in read_checkpoint(cfg["ckpt"], torch.float32)}
        self.plan = BucketPlan.from_named_tensors(self.tensors, budget_bytes=BUCKET_BYTES)
        self.report["num_buckets"] = len(self.plan.buckets)
        # The group is this trainer (rank 0) and every rank of the server (vLLM's own count).
        status, ranks = http_json("GET", self.url + "/get_world_size?include_dp=false")
        assert status == 200, ranks
        self.sender = TrainerWeightSender(
            master_port=cfg["port"],
            world_size=1 + int(ranks["world_size"]),
            group_name=cfg["group"],
            timeout_s=cfg["timeout_s"],
            backend=cfg.get("backend", "gloo"),
            device=device,
        )

    def call(self, name: str, path: str, body: Any = None, method: str = "POST") -> dict[str, Any]:
        started = time.perf_counter()
        status, answer = http_json(method, self.url + path, body, timeout=TRAINER_TIMEOUT_S)
        entry = {"step": name, "status": status, "answer": answer, "seconds": time.perf_counter() - started}
        self.report["steps"].append(entry)
        self.flush()
        return entry

    def flush(self) -> None:
        Path(self.cfg["out"]).write_text(json.dumps(self.report))

    def init(self) -> None:
        from router.trainer.rendezvous import alongside

        started = time.perf_counter()
        body = self.sender.init_request(1)
        alongside(
            lambda: self.call("init", "/init_weights_update_group", body),
            self.sender.join,
            timeout_s=TRAINER_TIMEOUT_S,
            what="init",
        )
        self.report["timings"]["init_s"] = round(time.perf_counter() - started, 3)

    def prepare_body(self, **fields: Any) -> dict[str, Any]:
        req = self.plan.prepare_request(
            self.cfg["group"], tensors=self.tensors, timeout_s=self.cfg["timeout_s"], **fields
        )
        return json.loads(req.to_json())

    def sync(self) -> None:
        from router.trainer.sender import sent_checksum

        cfg = self.cfg
        if cfg["pause"]:
            self.call("pause", "/pause?mode=abort")
        fmt = cfg.get("format")
        fields = {"load_format": fmt, "weight_version": cfg["version"], "atomic": cfg["atomic"]}
        started = time.perf_counter()
        prepare = self.call(
            "prepare",
            "/prepare_weights_update",
            {**self.prepare_body(**fields), "abort_all_requests": not cfg["pause"]},
        )
        if prepare["status"] != 200:
            return
        sent = time.perf_counter()
        stats = self.sender.send(self.plan, self.tensors, load_format=fmt)
        broadcast_done = time.perf_counter()
        complete = {"group_name": cfg["group"], "return_checksum": True, "timeout_s": cfg["timeout_s"]}
        self.call("complete", "/complete_weights_update", complete)
        ended = time.perf_counter()
        self.report["sent_checksum"] = sent_checksum(self.tensors.items())
        self.report["timings"].update(
            sync_s=round(ended - started, 3),
            prepare_s=round(sent - started, 3),
            broadcast_s=round(broadcast_done - sent, 3),
            complete_s=round(ended - broadcast_done, 3),
            bytes=stats.bytes,
            buckets=stats.buckets,
        )
        if cfg["pause"]:
            self.call("resume", "/resume")

    def refusals(self) -> None:
        group = self.cfg["group"]
        valid = self.prepare_body(weight_version="refused")
        self.call("not paused", "/prepare_weights_update", valid)
        self.call("pause", "/pause?mode=abort")
        wrong = json.loads(json.dumps(valid))
        bucket = wrong["buckets"][0]
        # Without sizes and checksums: the contract would refuse a wrong nbytes before the model is consulted.
        del bucket["nbytes"], bucket["checksum"]
        bucket["shapes"][0] = [*bucket["shapes"][0][:-1], bucket["shapes"][0][-1] + 1]
        self.call("wrong shape", "/prepare_weights_update", wrong)
        unknown = json.loads(json.dumps(valid))
        unknown["buckets"][0]["names"][0] = "model.layers.7.mlp.up_proj.weight"
        self.call("unknown name", "/prepare_weights_update", unknown)
        incomplete = json.loads(json.dumps(valid))
        incomplete["buckets"], incomplete["num_buckets"] = incomplete["buckets"][1:], len(incomplete["buckets"]) - 1
        self.call("incomplete", "/prepare_weights_update", incomplete)
        # Other bytes than announced (same names, dtypes and shapes): only the bucket's checksum can tell.
        self.call("prepare bad bytes", "/prepare_weights_update", valid)
        tampered = dict(self.tensors)
        name = self.plan.buckets[-1].names[0]
        tampered[name] = self.tensors[name] + 1.0
        self.sender.send(self.plan, tampered, load_format=None)
        complete = {"group_name": group, "return_checksum": True, "timeout_s": self.cfg["timeout_s"]}
        self.call("complete bad bytes", "/complete_weights_update", complete)
        self.call("prepare to abort", "/prepare_weights_update", valid)
        self.call("abort", "/abort_weights_update", {"group_name": group})
        self.call("resume", "/resume")

    def close(self) -> None:
        self.call("destroy", "/destroy_weights_update_group", {"group_name": self.cfg["group"]})
        self.sender.close()


def _trainer_main(cfg: dict[str, Any]) -> None:
    trainer = _Trainer(cfg)
    trainer.init()
    if step(trainer.report, "init")["status"] == 200:
        getattr(trainer, cfg["scenario"])()
        trainer.close()
    trainer.flush()


if __name__ == "__main__":
    import traceback

    config = json.loads(sys.argv[1])
    try:
        _trainer_main(config)
    except Exception:
        Path(config["out"]).write_text(json.dumps({"crash": traceback.format_exc()}))
