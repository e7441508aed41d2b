"""The trainer's copy of the served model, made trainable.

``CausalLM`` is built for serving: its parameters are frozen. The trainer
loads the same checkpoint into one, turns gradients on and trains through
``forward_logits``, the serving math outside inference mode, over the model's
own (fused) parameters. The optimizer updates those parameters in place,
so the checkpoint-named views from ``iter_checkpoint_tensors`` always hold
exactly the weights the workers must receive.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from router.trainer import sent_checksum
from worker.model import load_model, load_tokenizer


class TrainablePolicy:
    """A checkpoint loaded for training toward a fixed continuation of a fixed prompt.

    ``tensors`` maps every checkpoint name to a live view of the parameters:
    it is what the sender broadcasts and what the trainer's checksum covers.
    """

    def __init__(self, model_dir: str | Path, *, lr: float, updates_per_step: int):
        if updates_per_step < 1:
            raise ValueError(f"updates_per_step must be at least 1, got {updates_per_step}")
        self.model = load_model(model_dir, dtype=torch.float32)
        self.tokenizer = load_tokenizer(model_dir)
        for param in self.model.parameters():
            param.requires_grad_(True)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.updates_per_step = updates_per_step
        self.tensors = dict(self.model.iter_checkpoint_tensors())

    def loss(self, prompt_ids: list[int], target_ids: list[int]) -> torch.Tensor:
        """Teacher-forced cross-entropy of ``target_ids`` following ``prompt_ids``."""
        ids = torch.tensor(prompt_ids + target_ids[:-1], device=self.model.device)
        logits = self.model.forward_logits(ids)
        return F.cross_entropy(logits[len(prompt_ids) - 1 :], torch.tensor(target_ids, device=self.model.device))

    def train_step(self, prompt_ids: list[int], target_ids: list[int]) -> float:
        """``updates_per_step`` Adam updates on the target; returns the loss the step started from."""
        return optimizer_steps(self.optimizer, lambda: self.loss(prompt_ids, target_ids), self.updates_per_step)

    def checksum(self) -> str:
        """The weights checker's per-rank checksum of the current weights."""
        return sent_checksum(self.tensors.items())


def optimizer_steps(optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor], steps: int) -> float:
    """``steps`` updates of ``optimizer`` on ``loss()``; returns the loss the first one started from."""
    first: float | None = None
    for _ in range(steps):
        value = loss()
        first = value.item() if first is None else first
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
    assert first is not None
    return first
