"""The wire contract shared by the gateway, the worker and the trainer client.

Each HTTP body has exactly one pydantic definition here; every process parses it
once at its edge and passes the model on. The package also holds the flattened
bucket layout, the error shape, and (:mod:`router.contract.web`) the aiohttp
plumbing both servers use to enforce it. Nothing here imports torch.
"""
