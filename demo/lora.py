"""``python -m demo --lora``: the policy trained as a PEFT LoRA adapter, pushed to the fleet every step.

The workers serve the tiny checkpoint with ``--enable-lora``. The trainer loads the same checkpoint in
transformers, wraps it with ``peft.get_peft_model`` and trains only the adapter toward the demo's target.
After every step it pushes the adapter to every worker through the router in one call,
``RouterClient.load_lora_adapter_from_tensors`` (all workers or none; loading the same name again is an
update, and each worker reports the adapter's new ``lora_version``). The tensors travel as SGLang sends
them: pickled shared-memory handles that every worker on this machine opens, read through the workers'
restricted unpickler (``--allow-pickled-tensors``), so no adapter is written to disk.

Each step is then verified through the router: rollouts that name the adapter (``lora_path``) until every
worker has served one, each answer's ``meta_info.lora_version`` equal to what the push reported for the
worker that served it, and its greedy tokens equal to the trainer's own greedy generation with the PEFT
model. Exit status: 0 when every step verified; 1 on any failure; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import time
import urllib.error
import warnings
from dataclasses import dataclass
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
import torch.nn.functional as F

from demo.fleet import Fleet
from demo.lifecycle import Closer, run_demo
from demo.policy import optimizer_steps
from demo.table import shown, shown_tokens
from demo.trainer import DemoError, post_generate
from router.contract.fleet_answers import FleetAnswer
from router.contract.lora import LoraUpdateResult
from router.trainer import RouterCallError, RouterClient
from worker.model import load_tokenizer

#: The name the fleet serves the adapter under; every push after the first is an update of it.
ADAPTER_NAME = "policy"
LORA_RANK = 8
LORA_ALPHA = 16
#: Every attention and MLP projection of the tiny Llama (all the modules omni-worker's adapters may target).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: One adapter, of exactly the trained rank; the tensors push needs the restricted unpickler switched on.
WORKER_ARGS = [
    "--enable-lora",
    "--max-loras",
    "1",
    "--max-lora-rank",
    str(LORA_RANK),
    "--allow-pickled-tensors",
]
REQUEST_TIMEOUT_S = 30.0
#: How long a rollout naming a just-loaded adapter may keep getting 404: the router's data-plane
#: processes apply the adapter table shortly after the load answered.
ROUTED_WITHIN_S = 10.0
#: Rollouts per worker, at most, spent waiting for every worker to serve one: each data-plane process
#: of the router round-robins on its own, so a worker can be passed over a few times, never this often.
ROLLOUTS_PER_WORKER = 16


class LoraPolicy:
    """The tiny checkpoint in transformers with a fresh PEFT LoRA adapter; only the adapter trains."""

    def __init__(self, model_dir: Path, *, lr: float, updates_per_step: int, seed: int):
        import peft
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a weight-loading bar per start is noise here
        torch.manual_seed(seed)  # lora_A's random start: the same run every time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations, raised inside PEFT
            base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            self.config = peft.LoraConfig(
                r=LORA_RANK,
                lora_alpha=LORA_ALPHA,
                target_modules=LORA_TARGETS,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
            )
            self.model = peft.get_peft_model(base, self.config)
        self._state_dict = peft.get_peft_model_state_dict
        self.tokenizer = load_tokenizer(model_dir)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=lr)
        self.updates_per_step = updates_per_step

    def loss(self, prompt_ids: list[int], target_ids: list[int]) -> torch.Tensor:
        """Teacher-forced cross-entropy of ``target_ids`` following ``prompt_ids``."""
        logits = self.model(torch.tensor([prompt_ids + target_ids[:-1]])).logits[0]
        return F.cross_entropy(logits[len(prompt_ids) - 1 :], torch.tensor(target_ids))

    def train_step(self, prompt_ids: list[int], target_ids: list[int]) -> float:
        """``updates_per_step`` Adam updates of the adapter; returns the loss the step started from."""
        self.model.train()
        return optimizer_steps(self.optimizer, lambda: self.loss(prompt_ids, target_ids), self.updates_per_step)

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], steps: int) -> list[int]:
        """The trainer's own greedy continuation, one full forward per token (no cache shared with anything)."""
        self.model.eval()
        ids, out = list(prompt_ids), []
        for _ in range(steps):
            token = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
        return out

    def adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter in PEFT's saved names, detached copies: the copies are what gets shared."""
        return [(name, t.detach().clone()) for name, t in self._state_dict(self.model).items()]

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json`` as ``save_pretrained`` writes it (sets as lists), JSON-clean."""
        fields = {k: sorted(v) if isinstance(v, set) else v for k, v in self.config.to_dict().items()}
        loaded: dict[str, Any] = json.loads(json.dumps(fields))
        return loaded


def serialized(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """``tensors`` as SGLang's serializer sends them: a ``ForkingPickler`` pickle of shared-memory
    handles, base64. The workers open the segments while the push runs: keep ``tensors`` alive until then."""
    buf = io.BytesIO()
    ForkingPickler(buf, 2).dump(tensors)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class Answer:
    """One greedy rollout through the router: its tokens, the worker and the adapter version that served it."""

    output_ids: list[int]
    worker: str
    lora_name: str | None
    lora_version: int | None


@dataclass(frozen=True)
class Push:
    """One fleet-wide adapter push: each worker's reported ``lora_version``, wall time and adapter size."""

    versions: dict[str, int | None]
    seconds: float
    nbytes: int


def generate(router_url: str, prompt_ids: list[int], steps: int, lora: str | None) -> tuple[int, Answer | str]:
    """One greedy rollout through the router: ``(200, Answer)``, or ``(status, error text)``."""
    body: dict[str, Any] = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    served = post_generate(router_url, body, REQUEST_TIMEOUT_S)
    if isinstance(served, urllib.error.HTTPError):
        return served.code, served.read()[:500].decode(errors="replace")
    answer, worker = served
    meta = answer["meta_info"]
    return 200, Answer(list(answer["output_ids"]), worker, meta.get("lora_name"), meta.get("lora_version"))


class LoraTrainer:
    """Trains the adapter, pushes it through the router and verifies the fleet serves it."""

    def __init__(self, fleet: Fleet, policy: LoraPolicy, *, prompt: str, target: str):
        self.router_url = fleet.router_url
        self.client = RouterClient(fleet.router_url, admin_key=fleet.admin_key)
        self.policy = policy
        self.prompt_ids = policy.tokenizer.encode(prompt)
        self.target_ids = policy.tokenizer.encode(target)
        self.names = {w.id: f"worker{i}" for i, w in enumerate(self.client.list_workers().workers)}
        # The push hands the workers handles to the trainer's memory: file_system sharing names
        # segments any process on the machine can open (the default passes file descriptors instead).
        torch.multiprocessing.set_sharing_strategy("file_system")

    def push(self) -> Push:
        """The adapter to every worker in one router call (an update after the first)."""
        started = time.perf_counter()
        tensors = self.policy.adapter_tensors()
        answer: FleetAnswer[LoraUpdateResult] = self.client.load_lora_adapter_from_tensors(
            ADAPTER_NAME, self.policy.adapter_config(), [serialized(tensors)], load_format="direct"
        )
        seconds = time.perf_counter() - started
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        del tensors  # every worker has read them: the call returned only once each one had loaded
        if not answer.success or answer.worker_count != len(self.names):
            raise DemoError(f"the push reached {answer.worker_count} of {len(self.names)} workers: {answer.message}")
        versions = {r.worker: r.body.lora_version if r.body is not None else None for r in answer.results}
        return Push(versions=versions, seconds=seconds, nbytes=nbytes)

    def rollouts(self, lora: str | None) -> list[Answer]:
        """Greedy rollouts through the router until every worker has served one (bounded)."""
        answers: list[Answer] = []
        deadline = time.monotonic() + ROUTED_WITHIN_S
        limit = ROLLOUTS_PER_WORKER * len(self.names)
        while {a.worker for a in answers} < set(self.names):
            if len(answers) >= limit:
                missing = sorted(set(self.names) - {a.worker for a in answers})
                raise DemoError(f"{missing} served none of {limit} rollouts naming {lora!r}")
            status, answer = generate(self.router_url, self.prompt_ids, len(self.target_ids), lora)
            if isinstance(answer, Answer):
                answers.append(answer)
            elif status == 404 and lora is not None and time.monotonic() < deadline:
                time.sleep(0.1)  # the router's data planes have not applied the adapter table yet
            else:
                raise DemoError(f"/generate through the router answered {status}: {answer}")
        return answers

    def verify(self, answers: list[Answer], expected: list[int], push: Push | None) -> list[str]:
        """What is wrong with ``answers`` (nothing: every check passed)."""
        problems = []
        for a in answers:
            who = self.names.get(a.worker, a.worker)
            if a.output_ids != expected:
                problems.append(f"{who} answered {a.output_ids}, the trainer's PEFT model {expected}")
            if push is None:
                if a.lora_name is not None:
                    problems.append(f"{who} served the base-model rollout with adapter {a.lora_name!r}")
                continue
            if a.lora_name != ADAPTER_NAME:
                problems.append(f"{who} served the rollout with adapter {a.lora_name!r}, not {ADAPTER_NAME!r}")
            if a.lora_version is None or a.lora_version != push.versions.get(a.worker):
                problems.append(
                    f"{who} served lora_version {a.lora_version}, its push reported {push.versions.get(a.worker)}"
                )
        return list(dict.fromkeys(problems))  # a worker that served several rollouts wrong is named once


class LoraTable:
    """One row per step: the step's loss, the push (wall time, size, the versions the workers reported),
    then what the fleet served through the router and whether it equals the trainer's own generation."""

    def __init__(self, trainer: LoraTrainer):
        self.trainer = trainer
        decode = trainer.policy.tokenizer.decode
        self.decode = decode
        names = trainer.names.values()
        self.columns = [  # (title, width, alignment)
            ("step", 5, ">"),
            ("loss", 6, ">"),
            ("sync", 9, ">"),
            ("adapter", 9, ">"),
            ("lora_version", len(names) * 2, "<"),
            ("served by", len(" ".join(names)), "<"),
            ("rollout (greedy, through the router)", len(shown_tokens(trainer.target_ids, decode)), "<"),
            ("target", 6, ">"),
            ("= trainer", 9, ">"),
            ("verified", 0, "<"),
        ]

    def _line(self, *cells: str) -> str:
        return "  ".join(
            f"{cell:{align}{max(width, len(title))}}"
            for cell, (title, width, align) in zip(cells, self.columns, strict=True)
        ).rstrip()

    def header(self) -> None:
        print(self._line(*(title for title, _, _ in self.columns)))

    def row(self, step: int, loss: float, push: Push, answers: list[Answer], expected: list[int], ok: bool) -> None:
        names = self.trainer.names
        served = sorted({names.get(a.worker, a.worker) for a in answers})
        hits = sum(a == b for a, b in zip(answers[0].output_ids, self.trainer.target_ids, strict=False))
        equal = sum(a.output_ids == expected for a in answers)
        print(
            self._line(
                str(step),
                f"{loss:.3f}",
                f"{push.seconds * 1000:.1f} ms",
                f"{push.nbytes} B",
                " ".join(str(push.versions.get(w)) for w in names),
                " ".join(served),
                shown_tokens(answers[0].output_ids, self.decode),
                f"{hits}/{len(self.trainer.target_ids)}",
                f"{equal}/{len(answers)}",
                "ok" if ok else "FAILED",
            )
        )


def run(args: argparse.Namespace, fleet: Fleet, trainer: LoraTrainer) -> None:
    """Print the set-up, check the base model, train and push every step, print the outcome."""
    names, policy = trainer.names, trainer.policy
    listing = {w.id: w.url for w in trainer.client.list_workers().workers}
    print(f"router   {fleet.router_url}  (admin key required, round-robin routing)")
    for wid, name in names.items():
        print(f"{name:<8} {listing[wid]}  ({wid})")
    trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    print(
        f"trainer  pid {os.getpid()}: PEFT LoRA r={LORA_RANK} alpha={LORA_ALPHA} on {', '.join(LORA_TARGETS)} "
        f"({trained} trained parameters); {args.steps} steps of {args.updates_per_step} Adam updates (lr {args.lr:g})"
    )
    print(f"sync     one router call per step: load_lora_adapter_from_tensors {ADAPTER_NAME!r} on every worker")
    print(f"goal     {shown(args.prompt)} -> {shown(args.target)}\n")

    steps = len(trainer.target_ids)
    before = policy.greedy(trainer.prompt_ids, steps)  # lora_B starts at zero: the base model's answer
    problems = trainer.verify(trainer.rollouts(None), before, None)
    if problems:
        raise DemoError("the fleet's base model differs from the trainer's: " + "; ".join(problems))
    print(
        f"start: every worker's base-model rollout equals the trainer's untrained PEFT model "
        f"{shown_tokens(before, policy.tokenizer.decode)}\n"
    )

    table = LoraTable(trainer)
    table.header()
    last: list[Answer] = []
    for step in range(1, args.steps + 1):
        loss = policy.train_step(trainer.prompt_ids, trainer.target_ids)
        expected = policy.greedy(trainer.prompt_ids, steps)
        push = trainer.push()
        # One push per step on a fleet that started without the adapter: every worker is at version ``step``.
        problems = [f"{names.get(w, w)} reported lora_version {v}" for w, v in push.versions.items() if v != step]
        last = trainer.rollouts(ADAPTER_NAME)
        problems += trainer.verify(last, expected, push)
        table.row(step, loss, push, last, expected, not problems)
        if problems:
            raise DemoError(f"step {step} did not verify: " + "; ".join(problems))

    entry = next((a for a in trainer.client.fleet_adapters().adapters if a.name == ADAPTER_NAME), None)
    if entry is None or entry.version != args.steps or set(entry.holders) != set(names):
        raise DemoError(f"the router's adapter table does not show {args.steps} loads on every worker: {entry}")
    held = " ".join(f"{names[w]}=v{h.version}" for w, h in sorted(entry.holders.items(), key=lambda x: names[x[0]]))
    print(f"\nfleet adapter {ADAPTER_NAME!r}: version {entry.version} (source {entry.source}), held by {held}")
    print(f"{args.steps} of {args.steps} pushes verified: lora_version and greedy tokens equal the trainer's")
    learned = last[0].output_ids == trainer.target_ids
    print(f"final rollout {'matches' if learned else 'does not yet match'} the target {shown(args.target)}")


def main(args: argparse.Namespace) -> int:
    """Start the fleet with LoRA on, train and push the adapter, stop every process whatever happened."""

    def train(fleet: Fleet, policy: LoraPolicy, closers: list[Closer]) -> None:
        run(args, fleet, LoraTrainer(fleet, policy, prompt=args.prompt, target=args.target))

    return run_demo(
        workers=args.workers,
        seed=args.seed,
        tmp_prefix="omni-demo-lora-",
        build_policy=partial(LoraPolicy, lr=args.lr, updates_per_step=args.updates_per_step, seed=args.seed),
        train=train,
        detailed=RouterCallError,
        worker_args=WORKER_ARGS,
    )
