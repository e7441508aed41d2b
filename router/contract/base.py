"""Base classes of every wire message.

A request is parsed once at each process edge into its model and passed on
typed; a process that forwards it (the router) serializes the model again with
:meth:`WireRequest.to_json`, which sends exactly the fields the caller set plus
any fields this version does not know, so newer trainers keep working unchanged.
A response model says, through :attr:`WireResponse.ok`, whether it reports success; one that
can report a failure (:class:`OutcomeResponse`) is sent failed with ``error.message`` beside its fields.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Protocol, Self, runtime_checkable
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

# -- bounds of caller-supplied values: a 2 MB label or a 5 MB path is a 400, never copied around.

#: Identifiers chosen by callers: ``weight_version``, ``rid``, ``group_name``, tensor names, tags.
Label = Annotated[str, Field(max_length=256)]
#: Filesystem paths (``model_path``).
PathText = Annotated[str, Field(min_length=1, max_length=4096)]
#: Host names and addresses (``master_address``): at most 253 characters, as DNS allows.
HostText = Annotated[str, Field(min_length=1, max_length=253)]
#: Free text a caller may attach (``abort_message``, stop strings).
Text = Annotated[str, Field(max_length=4096)]
#: The most ranks a weight-update group may have: far above any fleet, far below what gloo would
#: allocate for a mistyped number (one connection per rank).
MAX_WORLD_SIZE = 8192
#: The most entries a caller's list may carry (tensor names of one bucket, rids, stop strings).
MAX_ITEMS = 65_536
#: The deepest JSON a request may nest; every message here is at most a few levels deep.
MAX_JSON_DEPTH = 32


def _is_dns_label(label: str) -> bool:
    # Underscores are accepted: container runtimes resolve service names that hold them.
    return (
        0 < len(label) <= 63
        and not label.startswith("-")
        and not label.endswith("-")
        and label.replace("-", "").replace("_", "").isalnum()
    )


def check_host(host: str) -> str:
    """A host name or an IP address, as a process would connect to it (no scheme, port, path or spaces)."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(text)
        return host
    except ValueError:
        pass
    try:
        encoded = text.encode("idna").decode("ascii")
    except UnicodeError:
        raise ValueError(f"{host!r} is not a valid host name") from None
    # Python's IDNA codec leaves hyphen placement to the caller, so the written
    # labels are checked as well as their encoded (length-bounded) form.
    labels = encoded.rstrip(".").split(".") + text.rstrip(".").split(".")
    if not all(_is_dns_label(label) for label in labels):
        raise ValueError(f"{host!r} is not a valid host name")
    return host


#: Hosts a worker URL may never point at: cloud metadata endpoints.
FORBIDDEN_HOSTS = frozenset({"169.254.169.254", "metadata.google.internal", "fd00:ec2::254"})


def canonical_worker_url(raw: str, what: str = "worker url") -> str:
    """A worker's base URL in canonical form (``http(s)://host[:port]``, no trailing slash), or
    ``ValueError`` naming ``what``: http or https only, a host, no user-info, path, query or
    fragment, no link-local or cloud-metadata host. One rule for every URL a process connects to
    because a caller named it (a registered worker, a peer to load weights from)."""
    text = raw.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid {what} {raw!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"invalid {what} {raw!r}: scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"invalid {what} {raw!r}: no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"invalid {what} {raw!r}: user-info is not allowed")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"invalid {what} {raw!r}: give only scheme://host:port")
    host = parts.hostname.lower()
    try:
        check_host(host)
    except ValueError as exc:
        raise ValueError(f"invalid {what} {raw!r}: {exc}") from None
    if host in FORBIDDEN_HOSTS:
        raise ValueError(f"invalid {what} {raw!r}: metadata hosts are not allowed")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_link_local:
        raise ValueError(f"invalid {what} {raw!r}: link-local addresses are not allowed")
    netloc = f"[{host}]" if ip is not None and ip.version == 6 else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    return f"{parts.scheme}://{netloc}"


class WireRequest(BaseModel):
    """A request body sent by a caller.

    Types are coerced as SGLang's and vLLM's servers coerce them: both validate
    their request models with pydantic in its default (lax) mode, and real
    trainers rely on it (AReaL sends ``"master_port": "29500"``). So a numeric
    string where a number belongs, an integral float (``3.0``) where an int
    belongs, ``"true"``/``"false"``/``0``/``1`` where a bool belongs are accepted and
    normalized; ``1.5`` where an int belongs, ``"hot"`` where a number belongs or a
    number where a string belongs are a 400. What this contract adds on top are
    bounds, never narrower types: ``NaN`` and infinities are refused, numbers have
    ranges, strings and lists the lengths above, JSON its depth. Unknown fields
    are accepted and kept (not validated, not used): real trainers send fields of
    newer or patched SGLang versions, and a router forwards them to workers that
    may know them. A router forwards the normalized values (:meth:`to_json`), so
    a worker behind it sees ``29500``, not ``"29500"``.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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


@runtime_checkable
class Explained(Protocol):
    """An answer that says in words how its call went (``message``: SGLang's admin answers, vLLM's)."""

    @property
    def message(self) -> str: ...


class FailureDetail(BaseModel):
    """``error`` of a failed answer: ``{"message"}`` (other keys a peer sends are kept)."""

    model_config = ConfigDict(extra="allow")

    message: str = ""


class OutcomeResponse(WireResponse):
    """A response that reports success or failure (:attr:`ok`, by its own fields).

    A failed one is answered with ``error: {"message"}`` beside its fields (:meth:`failed`): the
    admin shape SGLang's clients read and the project's error shape at once. ``error`` is left
    out while it is None, and comes after every field the answer declares (fields this version
    does not know follow, as in every answer)."""

    # Left out by a field rule rather than a model serializer: a wrap serializer makes pydantic build a
    # dict per answer, which a broadcast's answer (one per worker) pays on every call.
    error: FailureDetail | None = Field(default=None, exclude_if=lambda v: v is None)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # Pydantic orders fields from the deepest base up, which puts ``error`` first: move it last.
        fields = cls.__pydantic_fields__
        if next(reversed(fields)) != "error":
            fields["error"] = fields.pop("error")
            cls.model_rebuild(force=True)

    def failed(self, message: str) -> Self:
        """This answer as sent when it fails: with ``error.message`` set to ``message``."""
        return self.model_copy(update={"error": FailureDetail(message=message)})
