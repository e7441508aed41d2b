"""``python -m demo [--steps N] [--lora]``: the whole system on this machine, end to end.

Exit status: 0 when every sync succeeded and every worker's checksum equalled
the trainer's after every step; 1 on any failure; 130 when interrupted. Every
child process is stopped on the way out, whatever happened.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from functools import partial

from demo.fleet import Fleet
from demo.launch import free_port
from demo.lifecycle import Closer, run_demo
from demo.policy import TrainablePolicy
from demo.table import HASH_CHARS, StepTable, shown
from demo.trainer import DemoError, Trainer
from router.trainer import SyncError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=4, help="training steps (each ends with a weight sync)")
    p.add_argument("--workers", type=int, default=2, help="omni-worker processes behind the router")
    p.add_argument("--prompt", default="The policy says:", help="the fixed prompt of every rollout")
    p.add_argument("--target", default=" hello omni", help="the continuation the trainer teaches")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--updates-per-step", type=int, default=3, help="Adam updates per training step")
    p.add_argument("--bucket-kib", type=int, default=128, help="weight-sync bucket budget")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny random checkpoint")
    p.add_argument(
        "--lora",
        action="store_true",
        help="train a PEFT LoRA adapter instead of the full weights and push it to the fleet every step "
        "(docs/lora.md); --bucket-kib does not apply",
    )
    args = p.parse_args(argv)
    for name in ("steps", "workers", "updates_per_step", "bucket_kib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.target:
        p.error("--target must not be empty")
    return args


def run(args: argparse.Namespace, fleet: Fleet, trainer: Trainer) -> None:
    """Print the set-up, check the starting weights, train and sync, print the outcome."""
    client, policy = trainer.client, trainer.policy
    listing = client.list_workers().workers
    names = {w.id: f"worker{i}" for i, w in enumerate(listing)}
    print(f"router   {fleet.router_url}  (admin key required, round-robin routing)")
    for w in listing:
        print(f"{names[w.id]:<8} {w.url}  ({w.id})")
    print(
        f"trainer  pid {os.getpid()}: {args.steps} steps of {args.updates_per_step} Adam updates (lr {args.lr:g}); "
        f"{len(trainer.plan.buckets)} buckets, {trainer.plan.total_bytes / 1024:.0f} KiB per sync"
    )
    print(f"goal     {shown(args.prompt)} -> {shown(args.target)}\n")

    checked = client.weights_checker("checksum")
    start_sums = [c for w in names for c in checked.rank_checksums.get(w, [])]
    if not checked.identical or set(start_sums) != {policy.checksum()}:
        raise DemoError(f"the fleet does not start from the trainer's weights: {checked}")
    print(f"start: every worker holds the trainer's weights (checksum {policy.checksum()[:HASH_CHARS]})\n")

    table = StepTable(trainer.target_ids, names, policy.tokenizer.decode)
    table.header()
    first = None
    for step in range(1, args.steps + 1):
        result = trainer.step(step, n_rollouts=len(listing))
        first = first or result
        table.row(result)
    final = trainer.rollouts(len(listing))
    table.final(final)
    table.footnotes()

    assert first is not None
    assigned = first.sync.group_init.ranks if first.sync.group_init is not None else []
    ranks = ", ".join(f"{names.get(r.worker, r.worker)}={r.rank_offset}" for r in assigned)
    print(
        f"\nweight-update group: world size {first.sync.world_size}, trainer rank 0, ranks given by the router: {ranks}"
    )
    version = client.get_weight_version().weight_version
    if version != f"step-{args.steps}":
        raise DemoError(f"the fleet reports weight_version {version!r}, expected 'step-{args.steps}'")
    learned = final[0].output_ids == trainer.target_ids
    print(
        f"fleet weight_version: {version}; {args.steps} of {args.steps} syncs verified against the trainer's checksum"
    )
    print(f"final rollout {'matches' if learned else 'does not yet match'} the target {shown(args.target)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.lora:
        from demo import lora  # imports transformers and PEFT, which only this mode needs

        return lora.main(args)

    def train(fleet: Fleet, policy: TrainablePolicy, closers: list[Closer]) -> None:
        trainer = Trainer(
            fleet.router_url,
            fleet.admin_key,
            policy,
            prompt=args.prompt,
            target=args.target,
            group_port=free_port(),
            bucket_bytes=args.bucket_kib * 1024,
        )
        # Registered before the run, so the group is left whatever happens (the workers are told only after a clean run).
        closers.append(lambda ok: trainer.close(leave_group=ok))
        run(args, fleet, trainer)

    return run_demo(
        workers=args.workers,
        seed=args.seed,
        tmp_prefix="omni-demo-",
        build_policy=partial(TrainablePolicy, lr=args.lr, updates_per_step=args.updates_per_step),
        train=train,
        detailed=SyncError,
    )


if __name__ == "__main__":
    raise SystemExit(main())
