"""What the router's call groups (:class:`~router.trainer.adapter_calls.AdapterCalls`,
:class:`~router.trainer.vllm_calls.VllmCalls`) need from the client that sends them: one admin call and one
plain call, implemented once by :class:`~router.trainer.calls.RouterCalls`."""

from __future__ import annotations

from typing import Any, TypeVar

from router.contract.base import WireRequest, WireResponse
from router.contract.endpoint import Endpoint

A = TypeVar("A", bound=WireResponse)


def given(**fields: Any) -> dict[str, Any]:
    """Only the fields the caller gave: the rest keep the router's and the workers' defaults."""
    return {k: v for k, v in fields.items() if v is not None}


class Transport:
    """The two sends a group of calls is written against; :class:`~router.trainer.calls.RouterCalls` has them."""

    def _admin(
        self, endpoint: Endpoint[Any, Any], req: WireRequest, answer: type[A], expected_checksum: str | None = None
    ) -> A:
        raise NotImplementedError

    def _plain(self, method: str, path: str, answer: type[A], body: WireRequest | None = None) -> A:
        raise NotImplementedError
