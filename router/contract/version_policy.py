"""The weight-version policy a generation request may ask for, and its grammar.

A trainer names one in a request's ``X-Version-Policy`` header (SGLang Model Gateway's
``x-smg-version-policy`` too) and an operator the router's default (``--version-policy``); the router
resolves it against the fleet's recorded versions (:mod:`router.gateway.routing.version_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: The request header that asks for a policy, and SGLang Model Gateway's spelling of it.
POLICY_HEADER = "X-Version-Policy"
SMG_POLICY_HEADER = "x-smg-version-policy"

PolicyKind = Literal["latest-only", "max-staleness", "min-version", "any"]
POLICY_FORMS = "latest-only, max-staleness:K (K >= 0), min-version:V or any"


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """One parsed policy; ``text`` is its canonical spelling (the cache key and what errors name)."""

    kind: PolicyKind
    staleness: int = 0
    min_version: str | None = None
    adapters: frozenset[str] = frozenset()
    """The LoRA adapters the request names: only a worker holding each at its fleet version serves it.
    Not part of ``text``: floors do not depend on it."""
    text: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        text = {"max-staleness": f"{self.kind}:{self.staleness}", "min-version": f"{self.kind}:{self.min_version}"}
        object.__setattr__(self, "text", text.get(self.kind, self.kind))


LATEST_ONLY = VersionPolicy("latest-only")


def parse_version_policy(text: str) -> VersionPolicy:
    """``latest-only``, ``max-staleness:K``, ``min-version:V`` or ``any``; ``ValueError`` naming the forms."""
    raw = text.strip()
    name, sep, arg = raw.partition(":")
    name = name.strip().lower()
    if not sep and name in ("latest-only", "any"):
        return LATEST_ONLY if name == "latest-only" else VersionPolicy("any")
    if sep and name == "max-staleness":
        value = arg.strip()
        if value.isdigit() and len(value) <= 6:
            return VersionPolicy("max-staleness", staleness=int(value))
    if sep and name == "min-version" and arg.strip():
        return VersionPolicy("min-version", min_version=arg.strip())
    raise ValueError(f"unknown version policy {text[:100]!r}; use {POLICY_FORMS}")
