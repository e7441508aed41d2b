"""The router's HTTP calls to workers: one :class:`WorkerClient` over two transports.

``client`` (the one client and its pools), ``answer`` (a whole answer decoded into its contract
model), ``transport`` (what both transports offer, and their errors), ``lean_http`` and
``lean_conn`` (the keep-alive HTTP/1.1 client for ``http://`` workers), ``via_aiohttp``
(``https://`` workers).
"""

from router.gateway.upstream.answer import WorkerAnswer, decode_answer
from router.gateway.upstream.client import WorkerClient
from router.gateway.upstream.transport import NotAdmitted, UpstreamError, UpstreamResponse, mime_type

__all__ = [
    "NotAdmitted",
    "UpstreamError",
    "UpstreamResponse",
    "WorkerAnswer",
    "WorkerClient",
    "decode_answer",
    "mime_type",
]
