"""omni-router: the gateway, the shared wire protocol and the trainer-side HTTP client.

Nothing under this package imports torch.
"""

__version__ = "0.1.0"
