"""What the router reads of a real SGLang server beyond the routes omni-worker shares with it.

SGLang 0.5.23's ``GET /server_info`` (``entrypoints/http_server.py``, ``utils/common.py``
``build_server_info``) is its resolved server arguments, the scheduler's info and
``startup_time``: the durations of the phases of this process's start-up. SGLang reports no
process id, so the router takes ``startup_time`` (measured anew at every start) as the process's
identity. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from router.contract.base import WireResponse


class SglangServerIdentity(WireResponse):
    """``GET /server_info``, read only for the process identity and the ranks of one server."""

    startup_time: Any = None
    tp_size: int = 1
    pp_size: int = 1
    version: str | None = None

    def instance_id(self) -> str | None:
        """A stable digest of ``startup_time`` (``None`` when the server does not report it)."""
        if self.startup_time is None:
            return None
        text = json.dumps(self.startup_time, sort_keys=True, default=str)
        return "sglang-" + hashlib.sha256(text.encode()).hexdigest()[:16]
