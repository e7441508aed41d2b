"""omni-router's import root for everything but the inference worker (:mod:`worker`).

Two of its packages are shared by every process, two belong to one side each:

- :mod:`router.contract`: the wire contract the gateway, the worker and the trainer all speak
  (pydantic messages, the bucket layout, the timeout budget) and the aiohttp plumbing both
  servers share; no torch;
- :mod:`router.dataplane`: the torch half of that contract, the weight-sync data path shared by
  the trainer's sender and the worker's receiver;
- :mod:`router.gateway`: the ``omni-router`` server; imports the contract, never torch, the
  dataplane, the trainer client or the worker;
- :mod:`router.trainer`: what a trainer imports (the HTTP client and sync driver; the torch
  sender, loaded on first use, needs the ``trainer`` extra).

Dependencies point one way: gateway, trainer and :mod:`worker` → dataplane → contract
(the gateway skips the dataplane). Nothing here imports :mod:`worker`; ``tests/test_import_rules.py``
enforces these rules and docs/architecture.md explains them.
"""

__version__ = "0.1.0"
