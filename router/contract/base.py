"""Base classes of every wire message.

A request is parsed once at each process edge into its model and passed on
typed; a process that forwards it (the router) serializes the model again with
:meth:`WireRequest.to_json`, which sends exactly the fields the caller set plus
any fields this version does not know, so newer trainers keep working unchanged.
A response model says, through :attr:`WireResponse.ok`, whether it reports success.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireRequest(BaseModel):
    """A request body sent by a caller.

    Types are strict: ``"true"`` where a bool belongs, ``1.5`` or ``true`` where an
    int belongs is a 400, never a silent coercion. Unknown fields are accepted and
    kept (not validated, not used): real trainers send fields of newer or patched
    SGLang versions, and a router forwards them to workers that may know them.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    def to_json(self) -> bytes:
        """The body to forward: the fields the caller set (validated and normalized) and unknown ones."""
        return self.model_dump_json(exclude_unset=True).encode()


class WireResponse(BaseModel):
    """A response body; fields this version does not know are kept, so newer peers round-trip."""

    model_config = ConfigDict(extra="allow")

    @property
    def ok(self) -> bool:
        """Whether the answer reports success (a response with no success field always does)."""
        return True
