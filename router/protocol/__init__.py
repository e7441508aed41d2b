"""Wire messages shared by the router, the worker and the trainer client.

Each HTTP body has exactly one pydantic definition here; the router, the worker
and the client all import it, so the three sides cannot drift apart. Nothing in
this package imports torch.
"""
