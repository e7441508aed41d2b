"""The wire contract shared by the gateway, the worker and the trainer client.

Each HTTP body has exactly one pydantic definition here; every process parses it
once at its edge and passes the model on. The package also holds the flattened
bucket layout, the error shape, and (:mod:`router.contract.web`) the aiohttp
plumbing both servers use to enforce it.

It sits at the bottom of the dependency graph: the gateway, the trainer client,
:mod:`router.dataplane` and :mod:`worker` import it; it imports none of them and
never torch (only the standard library, pydantic and aiohttp).
"""
