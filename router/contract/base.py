"""Base classes for wire messages."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireRequest(BaseModel):
    """A request body sent by a caller.

    Unknown fields are ignored rather than rejected: real trainers send fields
    from newer or patched SGLang versions (``selector``, ``token_step``, ...) and
    must keep working unchanged. Types are strict enough that a string where a
    bool belongs is a 400, not a silent coercion.
    """

    model_config = ConfigDict(extra="ignore", strict=False)


class WireResponse(BaseModel):
    """A response body; extra fields are kept so newer peers round-trip."""

    model_config = ConfigDict(extra="allow")
