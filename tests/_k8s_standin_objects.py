"""The stand-in API server's named objects (Leases, ConfigMaps): get, create, replace and delete, each a
compare-and-swap the way the real API server does it. Used by :class:`tests._k8s_standin.StandInApiServer`,
which serves them over HTTP; this module holds only the rules, so they read in one place.

* Every mutation takes the next global resourceVersion (``next_rv``), stored in ``metadata.resourceVersion``.
* create: 409 ``AlreadyExists`` when the name is taken; 422 ``Invalid`` without ``metadata.name``.
* replace: 404 ``NotFound`` when absent (Leases and ConfigMaps are not created by a PUT); with a
  ``metadata.resourceVersion`` other than the stored one, 409 ``Conflict`` ("the object has been
  modified"); without one, the replace is unconditional (the API server allows that for both kinds).
  ``uid`` and ``creationTimestamp`` are the server's and survive a replace.
* delete: 404 when absent; a ``DeleteOptions`` body's ``preconditions.resourceVersion`` (or ``uid``) that
  does not match is 409 ``Conflict`` ("Precondition failed"); success answers a ``Status`` of ``Success``.
* A body naming another namespace or name than the URL is 400 ``BadRequest``. ``null`` fields are dropped,
  as the API server drops them.

Callers hold the server's lock; objects are stored as plain dicts and handed out as deep copies.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class Kind:
    plural: str
    kind: str
    api_version: str
    group: str = ""

    def qualified(self) -> str:
        """How the API server names the resource in messages (``leases.coordination.k8s.io``, ``configmaps``)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


LEASES = Kind("leases", "Lease", "coordination.k8s.io/v1", "coordination.k8s.io")
CONFIGMAPS = Kind("configmaps", "ConfigMap", "v1")


class Refusal(Exception):
    """An answer other than success: the server turns it into a ``Status`` with this code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


def without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


class NamedObjects:
    """Objects by (kind, namespace, name); see the module docstring for the rules."""

    def __init__(self, next_rv: Callable[[], int]):
        self._next_rv = next_rv
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    def snapshot(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.get((kind.plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def names(self, kind: Kind, namespace: str) -> list[str]:
        return sorted(n for k, ns, n in self._objects if k == kind.plural and ns == namespace)

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        obj = self.snapshot(kind, namespace, name)
        if obj is None:
            raise self._not_found(kind, name)
        return obj

    def create(self, kind: Kind, namespace: str, body: Any) -> dict[str, Any]:
        obj = self._checked(kind, namespace, body)
        name = obj["metadata"].get("name") or ""
        if not name:
            raise Refusal(
                422,
                "Invalid",
                f'{kind.kind} "" is invalid: metadata.name: Required value: name or generateName is required',
            )
        if (kind.plural, namespace, name) in self._objects:
            raise Refusal(
                409, "AlreadyExists", f'{kind.qualified()} "{name}" already exists', self._details(kind, name)
            )
        meta = obj["metadata"]
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        return self._store(kind, namespace, name, obj)

    def replace(self, kind: Kind, namespace: str, name: str, body: Any) -> dict[str, Any]:
        obj = self._checked(kind, namespace, body)
        if obj["metadata"].get("name", name) != name:
            raise Refusal(
                400,
                "BadRequest",
                f"the name of the object ({obj['metadata']['name']}) does not match the name on the URL ({name})",
            )
        stored = self._objects.get((kind.plural, namespace, name))
        if stored is None:
            raise self._not_found(kind, name)
        wanted = obj["metadata"].get("resourceVersion")
        if wanted is not None and wanted != stored["metadata"]["resourceVersion"]:
            raise self._conflict(
                kind,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        meta = obj["metadata"]
        meta.update(
            name=name,
            namespace=namespace,
            uid=stored["metadata"]["uid"],
            creationTimestamp=stored["metadata"]["creationTimestamp"],
        )
        return self._store(kind, namespace, name, obj)

    def delete(self, kind: Kind, namespace: str, name: str, options: Any) -> dict[str, Any]:
        stored = self._objects.get((kind.plural, namespace, name))
        if stored is None:
            raise self._not_found(kind, name)
        preconditions = options.get("preconditions") if isinstance(options, dict) else None
        if not isinstance(preconditions, dict):
            preconditions = {}
        for field in ("resourceVersion", "uid"):
            wanted, have = preconditions.get(field), stored["metadata"][field]
            if wanted is not None and wanted != have:
                label = "ResourceVersion" if field == "resourceVersion" else "UID"
                raise self._conflict(
                    kind,
                    name,
                    f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {have}",
                )
        del self._objects[(kind.plural, namespace, name)]
        self._next_rv()  # a deletion is a mutation: it takes a version too
        details = {**self._details(kind, name), "uid": stored["metadata"]["uid"]}
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}

    # -- helpers -------------------------------------------------------------------------------------------------

    def _checked(self, kind: Kind, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise Refusal(400, "BadRequest", f"the body of the request is not a {kind.kind} object")
        obj = without_nulls(copy.deepcopy(body))
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise Refusal(400, "BadRequest", "metadata is not an object")
        if meta.get("namespace", namespace) != namespace:
            raise Refusal(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        return obj

    def _store(self, kind: Kind, namespace: str, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._objects[(kind.plural, namespace, name)] = obj
        return copy.deepcopy(obj)

    def _details(self, kind: Kind, name: str) -> dict[str, Any]:
        details: dict[str, Any] = {"name": name, "kind": kind.plural}
        if kind.group:
            details["group"] = kind.group
        return details

    def _not_found(self, kind: Kind, name: str) -> Refusal:
        return Refusal(404, "NotFound", f'{kind.qualified()} "{name}" not found', self._details(kind, name))

    def _conflict(self, kind: Kind, name: str, why: str) -> Refusal:
        message = f'Operation cannot be fulfilled on {kind.qualified()} "{name}": {why}'
        return Refusal(409, "Conflict", message, self._details(kind, name))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
