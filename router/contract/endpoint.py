"""One admin route of the worker contract: :class:`Endpoint`, and what its rows are written with.

The rows, every worker admin route, are gathered in :mod:`router.contract.endpoints`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from router.contract.base import WireRequest, WireResponse
from router.contract.budget import APPLY_S, Budget

#: Covariant: an endpoint of any route is an ``Endpoint[WireRequest, WireResponse]`` (a table of several routes).
Req = TypeVar("Req", bound=WireRequest, covariant=True)
Resp = TypeVar("Resp", bound=WireResponse, covariant=True)

POST = ("POST",)
GET = ("GET",)
GET_POST = ("GET", "POST")


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req, Resp]):
    """One admin route of the worker contract."""

    path: str
    methods: tuple[str, ...]
    request: type[Req]
    response: type[Resp]
    budget: Budget
    serialized: bool = False
    """The router runs it under its admin update lock; the caller may first wait for the lock."""
    aliases: tuple[str, ...] = ()
    """Older names of the same route that workers also serve (SGLang's deprecated spellings)."""
    timeout_field: str | None = "timeout_s"
    """The request field that bounds this call's wait (a join, a receive), if the request declares it."""
    writes_weights: bool = False
    """The call may change the weights or their version label; its answer must say how (``weights``)."""
    summary: str = ""
    """One line for the API description."""
    query_params: bool = False
    """The route takes its arguments as query parameters, as vLLM's dev routes do (``/pause?mode=``):
    they win over the body's fields, and a list field takes every value of a repeated name."""
    bare_when_default: bool = False
    """The workers read no body on this route when every field is its default (SGLang's ``/flush_cache``
    takes none): a call that sets nothing is sent without one, as SGLang's router sends it."""

    @property
    def name(self) -> str:
        return self.path.lstrip("/")

    def timeout_of(self, req: WireRequest) -> float | None:
        """The request's own bound on its wait, if this route has one and the caller set it."""
        field = self.timeout_field
        if field is None or field not in type(req).model_fields:
            return None
        value = getattr(req, field)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def worker_bound(self, req: WireRequest) -> float:
        """The worker's deadline for this call."""
        return self.budget.bound(self.timeout_of(req))


#: An endpoint of any route.
AnyEndpoint = Endpoint[WireRequest, WireResponse]


def receive_budget(work_s: float) -> Budget:
    """A call that waits for a receive bounded by the body's ``timeout_s``, then applies it."""
    return Budget(work_s=work_s + APPLY_S, overhead_s=APPLY_S)
