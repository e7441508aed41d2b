"""Records in Kubernetes ConfigMaps (``--state-store k8s``): one copy every router replica reads.

Each record is one ConfigMap in the router's namespace, named ``<prefix>-<record name made
DNS-safe>`` (``omni-router-state-update-journal-json``), its content under one data key, the
record's own name. A record that is not UTF-8 goes under ``binaryData`` instead.

Invariants:

* **Every write is a compare-and-swap.** The store remembers, per record, the resourceVersion it
  last read or wrote. A write replaces the ConfigMap with that version; a record it last saw
  absent (or never read) is created, never replaced. A 409 (the version moved on, or the
  ConfigMap appeared) means another replica wrote the record since this one last saw it: the
  write raises :class:`OSError` saying so, and nothing is overwritten.
* **A remove deletes with a resourceVersion precondition**; a record already gone is removed.
* **Only a read or a write this store saw succeed teaches it a version.** After a conflict the
  record stays refused until it is read again (a new leader re-reads every record when it takes
  over, :mod:`router.gateway.leadership`).
* **A write whose answer was lost is recognised, not counted as a conflict.** When a write or
  remove got no answer (a timeout after sending), the content it carried is kept; if a later
  write then meets a conflict and the ConfigMap holds exactly that content (or is gone, for a
  remove), it was this store's own write, and its version is adopted.

Every call blocks on the API server (lightkube's synchronous ``Client``, each call bounded by
:data:`STORE_TIMEOUT_S`), so the router calls these on worker threads
(:mod:`router.gateway.state.durable`), never on its event loop. Needs the ``k8s`` extra.
"""

from __future__ import annotations

import base64
import binascii
import re
import threading
from typing import TYPE_CHECKING, Any

from router.gateway.k8s_extra import require_client

if TYPE_CHECKING:
    from lightkube import Client
    from lightkube.resources.core_v1 import ConfigMap

#: The default ``--state-configmap-prefix``.
DEFAULT_PREFIX = "omni-router-state"
#: How long one call to the API server may take.
STORE_TIMEOUT_S = 5.0
#: Labels on every ConfigMap the store writes (``kubectl get cm -l app.kubernetes.io/component=router-state``).
LABELS = {"app.kubernetes.io/part-of": "omni-router", "app.kubernetes.io/component": "router-state"}

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NOT_IN_NAME = re.compile(r"[^a-z0-9]+")
_UNKNOWN = object()  # no version known: the record was never read or written here
_DELETED = object()  # the unconfirmed operation was a remove


def configmap_name(prefix: str, record: str) -> str:
    """The ConfigMap that holds ``record``: ``<prefix>-<record>``, every run of other characters a ``-``."""
    name = f"{prefix}-{_NOT_IN_NAME.sub('-', record.lower()).strip('-')}"
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise ValueError(f"state record {record!r} with prefix {prefix!r} gives no valid ConfigMap name ({name!r})")
    return name


class StateConflict(OSError):
    """Another replica wrote (or removed) the record since this store last saw it: nothing was overwritten."""


class KubernetesStore:
    """One ConfigMap per record, written by compare-and-swap (see the module docstring)."""

    def __init__(self, namespace: str | None = None, prefix: str = DEFAULT_PREFIX, *, client: Client | None = None):
        require_client("--state-store k8s")
        if client is None:
            import httpx2
            from lightkube import Client
            from lightkube.core.exceptions import ConfigError

            try:
                client = Client(timeout=httpx2.Timeout(STORE_TIMEOUT_S), field_manager="omni-router")
            except ConfigError as exc:  # no service account, KUBECONFIG or ~/.kube/config: a start-up mistake
                raise ValueError(f"--state-store k8s: no Kubernetes client configuration ({exc})") from None
        self._client = client
        self.namespace: str = namespace or client.namespace
        self.prefix = prefix
        configmap_name(prefix, "record")  # a bad prefix fails here, at start-up
        self._versions: dict[str, object] = {}  # record -> resourceVersion (str), None (absent) or _UNKNOWN
        self._unconfirmed: dict[str, object] = {}  # record -> bytes, or _DELETED, of a call that got no answer
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"ConfigMaps {self.namespace}/{self.prefix}-*"

    def problem(self) -> str | None:
        """The API server's refusals surface on each write; nothing is known to fail in advance."""
        return None

    def read(self, name: str) -> bytes | None:
        found, version = self._get(name)
        self._learn(name, version)
        return None if found is None else _content(found, name)

    def write(self, name: str, data: bytes) -> None:
        self._write(name, data, adopt_lost=True)

    def remove(self, name: str) -> None:
        self._remove(name, adopt_lost=True)

    # -- one compare-and-swap each ------------------------------------------------------------------------

    def _write(self, name: str, data: bytes, *, adopt_lost: bool) -> None:
        from lightkube import ApiError
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import ConfigMap

        known = self._version(name)
        meta = ObjectMeta(name=self._cm(name), namespace=self.namespace, labels=dict(LABELS))
        body = ConfigMap(metadata=meta, **_payload(name, data))
        try:
            if isinstance(known, str):
                meta.resourceVersion = known
                stored = self._client.replace(body)
            else:  # last seen absent, or never read: create, so that nothing is overwritten blindly
                stored = self._client.create(body)
        except ApiError as exc:
            if exc.status.code in (404, 409):
                if adopt_lost and self._adopt_own_lost_call(name):
                    return self._write(name, data, adopt_lost=False)
                raise self._conflict(name, known, exc) from None
            raise OSError(f"writing {self._where(name)}: {_describe(exc)}") from None
        except Exception as exc:  # the transport: the write may or may not have reached the API server
            self._unconfirmed_call(name, data)
            raise OSError(f"writing {self._where(name)}: {_describe(exc)}") from None
        self._learn(name, stored.metadata.resourceVersion if stored.metadata else _UNKNOWN)

    def _remove(self, name: str, *, adopt_lost: bool) -> None:
        from lightkube import ApiError

        known = self._version(name)
        if not isinstance(known, str):
            # Believed absent or never read: done if it is absent; if it exists, this store never saw that version.
            found, version = self._get(name)
            if found is None:
                self._learn(name, None)
                return
            if not (adopt_lost and self._adopt_own_lost_call(name)):
                raise self._conflict(name, known, None)
            known = version
        try:
            self._delete(self._cm(name), str(known))
        except ApiError as exc:
            if exc.status.code == 404:  # already gone: removed
                self._learn(name, None)
                return
            if exc.status.code == 409:
                if adopt_lost and self._adopt_own_lost_call(name):
                    return self._remove(name, adopt_lost=False)
                raise self._conflict(name, known, exc) from None
            raise OSError(f"removing {self._where(name)}: {_describe(exc)}") from None
        except Exception as exc:
            self._unconfirmed_call(name, _DELETED)
            raise OSError(f"removing {self._where(name)}: {_describe(exc)}") from None
        self._learn(name, None)

    def _delete(self, cm_name: str, version: str) -> None:
        """DELETE with ``preconditions.resourceVersion``. lightkube's ``Client.delete`` sends no body, so its
        own request pipeline (authentication, error mapping) is used with the DeleteOptions body added."""
        from lightkube.resources.core_v1 import ConfigMap

        generic = self._client._client
        request = generic.prepare_request("delete", ConfigMap, name=cm_name, namespace=self.namespace)
        request.data = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": version}}
        generic.handle_response("delete", generic.send(generic.build_adapter_request(request)), request)

    def _get(self, name: str) -> tuple[ConfigMap | None, str | None]:
        from lightkube import ApiError
        from lightkube.resources.core_v1 import ConfigMap

        try:
            found = self._client.get(ConfigMap, self._cm(name), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                return None, None
            raise OSError(f"reading {self._where(name)}: {_describe(exc)}") from None
        except Exception as exc:
            raise OSError(f"reading {self._where(name)}: {_describe(exc)}") from None
        return found, found.metadata.resourceVersion if found.metadata else None

    def _unconfirmed_call(self, name: str, left: object) -> None:
        """A write or remove got no answer: remember what it would have left (bytes, or :data:`_DELETED`)."""
        with self._lock:
            self._unconfirmed[name] = left

    def _adopt_own_lost_call(self, name: str) -> bool:
        """A conflict after a call that got no answer: if the ConfigMap is what that call left, adopt its version."""
        with self._lock:
            lost = self._unconfirmed.get(name, _UNKNOWN)
        if lost is _UNKNOWN:
            return False
        found, version = self._get(name)
        left = _DELETED if found is None else _content(found, name)
        if left != lost:
            return False
        self._learn(name, version)
        return True

    # -- bookkeeping ---------------------------------------------------------------------------------------

    def _version(self, name: str) -> object:
        with self._lock:
            return self._versions.get(name, _UNKNOWN)

    def _learn(self, name: str, version: object) -> None:
        with self._lock:
            self._versions[name] = version
            self._unconfirmed.pop(name, None)

    def _cm(self, name: str) -> str:
        return configmap_name(self.prefix, name)

    def _where(self, name: str) -> str:
        return f"state record {name} (ConfigMap {self.namespace}/{self._cm(name)})"

    def _conflict(self, name: str, known: object, exc: Exception | None) -> StateConflict:
        seen = f"resourceVersion {known}" if isinstance(known, str) else "it absent"
        detail = f" ({_describe(exc)})" if exc is not None else ""
        return StateConflict(
            f"{self._where(name)} was written by another router replica since this one last saw {seen}; "
            f"not overwritten{detail}"
        )


def _payload(name: str, data: bytes) -> dict[str, Any]:
    try:
        return {"data": {name: data.decode("utf-8")}}
    except UnicodeDecodeError:
        return {"binaryData": {name: base64.b64encode(data).decode("ascii")}}


def _content(found: ConfigMap, name: str) -> bytes | None:
    """The record's bytes in ``found`` (``None`` when the ConfigMap has no such key)."""
    if found.data and name in found.data:
        text: str = found.data[name]
        return text.encode("utf-8")
    if found.binaryData and name in found.binaryData:
        try:
            return base64.b64decode(found.binaryData[name], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise OSError(f"state record {name}: binaryData is not base64 ({exc})") from None
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
