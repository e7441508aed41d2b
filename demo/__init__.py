"""The main job: a router, two CPU workers and a trainer, end to end.

``python -m demo`` (or ``make demo``) starts an ``omni-router`` in front
of two ``omni-worker`` processes serving a tiny random Llama, then runs a small
trainer in this process. Each step the trainer samples greedy rollouts through
the router, takes an optimizer step that teaches the model to continue a fixed
prompt with a fixed target, and syncs the new weights through the router with
the trainer client's ``sync_weights`` (group init once, pause, prepare,
broadcast, complete, verify the fleet's checksums against its own, continue).

- :mod:`demo.fleet`: start and stop the router and worker processes.
- :mod:`demo.policy`: the trainer's copy of the model, made trainable.
- :mod:`demo.trainer`: rollouts, optimizer steps and weight syncs.
- :mod:`demo.table`: the per-step table printed as it runs.
- :mod:`demo.lifecycle`: one run's start, failure report, clean-up and exit status (both demos).
- :mod:`demo.lora`: ``python -m demo --lora``, the same loop with the policy trained as a LoRA adapter.
"""
