"""omni-router: the import root of the torch-free side of the project.

- :mod:`router.contract`: the wire contract every process speaks (pydantic messages,
  the bucket layout, the timeout budget) and the aiohttp plumbing both servers share;
- :mod:`router.gateway`: the ``omni-router`` server;
- :mod:`router.trainer`: what a trainer imports (the HTTP client and sync driver; the
  torch sender is imported lazily);
- :mod:`router.dataplane`: the torch half of the weight-sync contract, shared by the
  trainer's sender and the worker's receiver.

The gateway, the contract and the trainer's HTTP client never import torch.
"""

__version__ = "0.1.0"
