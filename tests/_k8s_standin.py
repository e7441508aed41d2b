"""A stand-in Kubernetes API server for tests: pods (list and watch), Leases and ConfigMaps, over plain HTTP
on loopback.

This is NOT a Kubernetes API server. It imitates the slice of the API that the router's lightkube clients use:
the core/v1 pod API of a discovery loop built on ``lightkube.AsyncClient`` (list, then watch from the list's
resourceVersion, relist on 410), and the compare-and-swap get/create/replace/delete of coordination.k8s.io/v1
Leases (leader election) and core/v1 ConfigMaps (the router's state store), closely enough that the real client
library runs unmodified against it. It only ever binds 127.0.0.0/8.

Served endpoints (anything else answers a 404 ``Status``)::

    GET /api/v1/namespaces/{ns}/pods           list, or watch with ?watch=true|1
    GET /api/v1/pods                           the same across all namespaces
    GET /api/v1/namespaces/{ns}/pods/{name}    one pod, or a 404 Status
    POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases               create
    GET|PUT|DELETE /apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}   get, replace, delete
    POST /api/v1/namespaces/{ns}/configmaps                                 create
    GET|PUT|DELETE /api/v1/namespaces/{ns}/configmaps/{name}                get, replace, delete

Protocol behaviour, as a real API server (with its watch cache) does it:

* Every mutation takes the next value of one global, strictly increasing resourceVersion (decimal string),
  stored in the object's ``metadata.resourceVersion``. A list's ``metadata.resourceVersion`` is the global
  one at the time of the list.
* ``labelSelector``: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``, ``k>N``,
  ``k<N``; commas AND the requirements. ``!=`` and ``notin`` also match pods without the label.
  ``fieldSelector``: ``=``, ``==``, ``!=`` on metadata.name, metadata.namespace, spec.nodeName,
  spec.restartPolicy, spec.schedulerName, spec.serviceAccountName, status.phase, status.podIP. A malformed
  selector or an unsupported field answers 400 BadRequest.
* ``limit``/``continue``: pages come from a snapshot taken at the first page, in (namespace, name) order,
  all carrying the snapshot's resourceVersion; ``compact()`` expires open continue tokens (410).
  A list's ``resourceVersion`` parameter is ignored (the list is always served from current state).
* Watch: with ``resourceVersion`` R (not "0"), every event newer than R is replayed from history, then live
  events follow. Without one, or with "0", a synthetic ADDED is sent for every pod currently matching (in
  (namespace, name) order, each with its own resourceVersion), then live events. An R older than the
  compacted history gets HTTP 200 with a single ERROR event (Status 410 "Expired",
  ``too old resource version: R (C)``) and the stream ends. An R newer than the current version simply
  waits for events past it. ``timeoutSeconds`` ends the stream cleanly (terminating chunk).
  ``allowWatchBookmarks=true`` streams receive BOOKMARK events on ``send_bookmark()``.
* Selector transitions follow the apiserver's watch cache: a pod that starts matching is delivered as
  ADDED, one that stops matching as DELETED (its previous state, stamped with the event's
  resourceVersion), one that matches before and after as MODIFIED. A real deletion is DELETED with the
  final state and a fresh resourceVersion.
* Errors are ``Status`` objects with ``Content-Type: application/json`` (exactly that: lightkube only turns
  HTTP errors into ``ApiError`` when the header matches it).
* Leases and ConfigMaps (:mod:`tests._k8s_standin_objects`): every create, replace and delete takes the next
  global resourceVersion too. create: 409 AlreadyExists when the name is taken. replace: 404 when absent, 409
  Conflict when the body's ``metadata.resourceVersion`` is not the stored one (no version: unconditional).
  delete: 404 when absent, 409 Conflict when the ``DeleteOptions`` body's ``preconditions.resourceVersion``
  (or ``uid``) does not match. These objects are not in the pod watch history.
* Authentication: when ``token`` is set (the default), requests without ``Authorization: Bearer <token>``
  (or another token given to ``add_token`` / ``write_kubeconfig(token=...)``) get a 401 Unauthorized Status,
  as an API server without anonymous access does.
* Partition: ``block_token(token, hang_s=...)`` makes every request presenting that token hang (it is still
  recorded) for up to ``hang_s`` seconds, after which its connection is cut without an answer; ``hang_s=0``
  cuts at once. ``unblock_token`` lets later requests through; one still hanging is cut then, never answered
  late. One client (one router replica with its own kubeconfig) is thus cut off while the others are not.

Control API, callable from any thread (mutations take a lock and hand events to the server loop with
``call_soon_threadsafe``, so order is preserved). Everything is synchronous. start/stop/suspend/resume/
drop_watches only wait on the server's own thread, so a coroutine may call them directly; wait_for_watchers
and wait_until wait for the client, so a coroutine whose client runs on the same loop must call them
through ``asyncio.to_thread``::

    srv = StandInApiServer()                  # host must be in 127.0.0.0/8
    srv.start() / srv.stop()                  # or `with StandInApiServer() as srv:`; serves on a thread
    srv.url, srv.port, srv.suspended          # "http://127.0.0.1:PORT" (port chosen by the OS at start)
    srv.write_kubeconfig(path, namespace=..., token=None)  # kubeconfig for KubeConfig.from_file / KUBECONFIG
                                              # (token: a client of its own, accepted from then on)
    srv.add_token(token)                      # accept another bearer token
    srv.block_token(token, hang_s=30.0)       # partition that token's client (see above)
    srv.unblock_token(token)
    srv.suspend() / srv.resume()              # stop listening + cut every connection / listen on the same port
    srv.add_pod(name, ip=..., port=..., labels=..., ready=..., phase=...)  -> pod dict (ADDED)
    srv.set_ready / set_phase / set_labels / mark_terminating(name)        -> pod dict (MODIFIED)
    srv.delete_pod(name)                      -> final pod dict (DELETED)
    srv.compact()                             # forget history: older watch RVs and continue tokens get 410
    srv.drop_watches(graceful=False)          # cut every open watch (graceful=True: end them cleanly)
    srv.send_bookmark()                       # BOOKMARK to streams that asked for allowWatchBookmarks
    srv.pods(namespace) / srv.pod(name)       # snapshots (deep copies)
    srv.lease(name, namespace) / srv.config_map(name, namespace)   # snapshots, or None
    srv.config_maps(namespace)                # names of the ConfigMaps in namespace
    srv.resource_version                      # current global resourceVersion (str)
    srv.requests                              # [RecordedRequest(method, path, query, authorization), ...]
    srv.list_count / srv.watch_count          # pod list / watch requests received so far
    srv.active_watches                        # watch streams open now
    srv.wait_for_watchers(n, timeout)         # block until at least n watch streams are open
    srv.wait_until(predicate, timeout)        # block until predicate() holds (re-checked on every change)

How lightkube 1.x reacts (``AsyncClient.watch`` loops ``while True`` over watch requests):

* A stream that ends cleanly (``timeoutSeconds``, ``drop_watches(graceful=True)``) is re-requested by
  lightkube itself from the last resourceVersion it yielded, so iteration just continues.
* An abruptly cut stream (``drop_watches()``, ``suspend()``) is an ``httpx2.RemoteProtocolError``
  (incomplete chunked read), raised out of the iteration with the default ``on_error=on_error_raise``.
* An ERROR event is raised as ``lightkube.ApiError`` (``status.code == 410`` for an expired version).
* Connecting while suspended raises ``httpx2.ConnectError`` at once (lightkube does not retry requests).
* lightkube honours HTTP(S)_PROXY from the environment; put 127.0.0.1 in NO_PROXY if one is set.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import ipaddress
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from aiohttp import web

from tests._k8s_standin_objects import CONFIGMAPS, LEASES, Kind, NamedObjects, Refusal

__all__ = [
    "LabelRequirement",
    "RecordedRequest",
    "SelectorError",
    "StandInApiServer",
    "parse_field_selector",
    "parse_label_selector",
]

_START_RV = 1000  # realistic-looking versions; also makes "0" and small numbers clearly "too old"
_MAX_SNAPSHOTS = 64  # list snapshots kept for continue tokens
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})  # Go's strconv.ParseBool
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})


# ---------------------------------------------------------------------------------------------------------------
# Selectors


class SelectorError(ValueError):
    """A label or field selector the real API server would reject with 400."""


_KEY_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_LABEL_KEY = re.compile(rf"^(?:{_DNS_SUBDOMAIN}/)?{_KEY_NAME}$")
_LABEL_VALUE = re.compile(rf"^(?:{_KEY_NAME})?$")
_TOKEN = re.compile(r"\s*(?:(?P<op>==|!=|=|!|\(|\)|,|<|>)|(?P<word>[^\s!=(),<>]+))")


def _check_label(key: str, value: str | None = None) -> None:
    if not _LABEL_KEY.match(key) or len(key.rpartition("/")[0]) > 253:
        raise SelectorError(f"invalid label key {key!r}")
    if value is not None and not _LABEL_VALUE.match(value):
        raise SelectorError(f"invalid label value {value!r} for key {key!r}")


class LabelRequirement(NamedTuple):
    """One requirement of a label selector: ``op`` is one of = != in notin exists !exists > <."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        # > and < compare integers; a missing or non-integer label never matches.
        try:
            have = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        want = int(self.values[0])
        return have > want if self.op == ">" else have < want


def _lex(selector: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    stripped = selector.rstrip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None or m.end() == pos:
            raise SelectorError(f"unable to parse requirement: unexpected character at {pos} in {selector!r}")
        tokens.append(("op", m["op"]) if m["op"] else ("word", m["word"]))
        pos = m.end()
    return tokens


def parse_label_selector(selector: str) -> list[LabelRequirement]:
    """Parse a label selector string the way the API server does; raises SelectorError when it would 400."""
    tokens = _lex(selector)
    reqs: list[LabelRequirement] = []
    i = 0

    def peek() -> tuple[str, str] | None:
        return tokens[i] if i < len(tokens) else None

    def take(kind: str, what: str) -> str:
        nonlocal i
        tok = peek()
        if tok is None or tok[0] != kind:
            raise SelectorError(f"unable to parse requirement: expected {what} in {selector!r}")
        i += 1
        return tok[1]

    if not tokens:
        return reqs
    while True:
        tok = peek()
        if tok == ("op", "!"):
            i += 1
            key = take("word", "a label key after '!'")
            _check_label(key)
            reqs.append(LabelRequirement(key, "!exists"))
        else:
            key = take("word", "a label key")
            _check_label(key)
            tok = peek()
            if tok is None or tok == ("op", ","):
                reqs.append(LabelRequirement(key, "exists"))
            elif tok[0] == "op" and tok[1] in ("=", "==", "!="):
                i += 1
                nxt = peek()
                value = take("word", "a value") if nxt is not None and nxt[0] == "word" else ""
                _check_label(key, value)
                reqs.append(LabelRequirement(key, "!=" if tok[1] == "!=" else "=", (value,)))
            elif tok[0] == "op" and tok[1] in ("<", ">"):
                i += 1
                value = take("word", "an integer")
                if not re.fullmatch(r"-?\d+", value):
                    raise SelectorError(f"unable to parse requirement: for '{tok[1]}', {value!r} is not an integer")
                reqs.append(LabelRequirement(key, tok[1], (value,)))
            elif tok in (("word", "in"), ("word", "notin")):
                i += 1
                if peek() != ("op", "("):
                    raise SelectorError(f"unable to parse requirement: expected '(' after {tok[1]!r} in {selector!r}")
                i += 1
                values: list[str] = []
                while True:
                    nxt = peek()
                    value = take("word", "a value") if nxt is not None and nxt[0] == "word" else ""
                    _check_label(key, value)
                    values.append(value)
                    sep = peek()
                    if sep == ("op", ","):
                        i += 1
                        continue
                    if sep == ("op", ")"):
                        i += 1
                        break
                    raise SelectorError(f"unable to parse requirement: expected ',' or ')' in {selector!r}")
                reqs.append(LabelRequirement(key, tok[1], tuple(values)))
            else:
                raise SelectorError(f"unable to parse requirement: unexpected {tok[1]!r} after {key!r}")
        tok = peek()
        if tok is None:
            return reqs
        if tok != ("op", ","):
            raise SelectorError(f"unable to parse requirement: expected ',' in {selector!r}")
        i += 1
        if peek() is None:
            raise SelectorError(f"unable to parse requirement: trailing ',' in {selector!r}")


def _spec_field(name: str, default: str = "") -> Callable[[dict[str, Any]], str]:
    return lambda pod: str(pod["spec"].get(name, default))


_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda pod: pod["metadata"]["name"],
    "metadata.namespace": lambda pod: pod["metadata"]["namespace"],
    "spec.nodeName": _spec_field("nodeName"),
    "spec.restartPolicy": _spec_field("restartPolicy"),
    "spec.schedulerName": _spec_field("schedulerName"),
    "spec.serviceAccountName": _spec_field("serviceAccountName"),
    "status.phase": lambda pod: pod["status"].get("phase", ""),
    "status.podIP": lambda pod: pod["status"].get("podIP", ""),
}


def parse_field_selector(selector: str) -> list[tuple[str, bool, str]]:
    """Parse a pod field selector into (field, equal?, value) terms; raises SelectorError when it would 400."""
    terms: list[tuple[str, bool, str]] = []
    if not selector.strip():
        return terms
    for part in selector.split(","):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|!=|=)\s*(.*?)\s*", part)
        if m is None:
            raise SelectorError(f"invalid selector: {selector!r}; can't understand {part!r}")
        if m[1] not in _FIELDS:
            raise SelectorError(f"field label not supported: {m[1]}")
        terms.append((m[1], m[2] != "!=", m[3]))
    return terms


@dataclass(frozen=True)
class _Filter:
    namespace: str | None
    labels: tuple[LabelRequirement, ...] = ()
    fields: tuple[tuple[str, bool, str], ...] = ()

    def matches(self, pod: dict[str, Any]) -> bool:
        if self.namespace is not None and pod["metadata"]["namespace"] != self.namespace:
            return False
        labels = pod["metadata"].get("labels") or {}
        if not all(req.matches(labels) for req in self.labels):
            return False
        return all((_FIELDS[name](pod) == value) == eq for name, eq, value in self.fields)


# ---------------------------------------------------------------------------------------------------------------
# Pods and events


def _timestamp(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_loopback(address: str, what: str) -> None:
    try:
        ok = ipaddress.ip_address(address) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what} must be an IPv4 address in 127.0.0.0/8, got {address!r}")


_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


@dataclass
class _Pod:
    name: str
    namespace: str
    ip: str
    port: int
    labels: dict[str, str]
    ready: bool
    phase: str
    image: str
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    created: str = field(default_factory=_timestamp)
    deletion: str | None = None
    ready_changed: str = field(default_factory=_timestamp)
    obj: dict[str, Any] = field(default_factory=dict)

    def render(self, rv: int) -> dict[str, Any]:
        """The pod as the API server would serve it, at resourceVersion ``rv``."""
        ready = self.ready and self.phase == "Running"
        ready_s = "True" if ready else "False"
        started = self.created

        def condition(kind: str, status: str = "True", since: str = started) -> dict[str, Any]:
            cond: dict[str, Any] = {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
            if status == "False":
                cond["reason"] = "PodCompleted" if self.phase in ("Succeeded", "Failed") else "ContainersNotReady"
                cond["message"] = "containers with unready status: [worker]"
            return cond

        if self.phase == "Pending":
            state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        elif self.phase in ("Succeeded", "Failed"):
            code = 0 if self.phase == "Succeeded" else 1
            reason = "Completed" if code == 0 else "Error"
            state = {"terminated": {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": started}}
        else:
            state = {"running": {"startedAt": started}}
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": str(rv),
            "creationTimestamp": self.created,
        }
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.deletion is not None:
            metadata["deletionTimestamp"] = self.deletion
            metadata["deletionGracePeriodSeconds"] = 30
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": metadata,
            "spec": {
                "containers": [
                    {
                        "name": "worker",
                        "image": self.image,
                        "ports": [{"name": "http", "containerPort": self.port, "protocol": "TCP"}],
                        "readinessProbe": {
                            "httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
                            "periodSeconds": 5,
                            "timeoutSeconds": 1,
                            "successThreshold": 1,
                            "failureThreshold": 3,
                        },
                        "resources": {},
                        "terminationMessagePath": "/dev/termination-log",
                        "terminationMessagePolicy": "File",
                        "imagePullPolicy": "IfNotPresent",
                    }
                ],
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 30,
                "dnsPolicy": "ClusterFirst",
                "serviceAccountName": "default",
                "nodeName": "stand-in-node",
                "schedulerName": "default-scheduler",
                "enableServiceLinks": True,
                "priority": 0,
            },
            "status": {
                "phase": self.phase,
                "conditions": [
                    condition("PodReadyToStartContainers"),
                    condition("Initialized"),
                    condition("Ready", ready_s, self.ready_changed),
                    condition("ContainersReady", ready_s, self.ready_changed),
                    condition("PodScheduled"),
                ],
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "startTime": started,
                "containerStatuses": [
                    {
                        "name": "worker",
                        "state": state,
                        "lastState": {},
                        "ready": ready,
                        "restartCount": 0,
                        "image": self.image,
                        "imageID": f"docker-pullable://{self.image}@sha256:{'0' * 64}",
                        "containerID": f"containerd://{self.uid.replace('-', '')}",
                        "started": self.phase == "Running",
                    }
                ],
                "qosClass": "BestEffort",
            },
        }


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED (as stored; per-watcher conversion may change it)
    obj: dict[str, Any]
    prev: dict[str, Any] | None

    def for_watcher(self, flt: _Filter) -> tuple[str, dict[str, Any]] | None:
        """What a watcher with this filter sees of the event (the apiserver watch cache's rules)."""
        now = self.type != "DELETED" and flt.matches(self.obj)
        before = self.prev is not None and flt.matches(self.prev)
        if now:
            return ("MODIFIED" if before else "ADDED"), self.obj
        if not before:
            return None
        if self.type == "DELETED":
            return "DELETED", self.obj
        assert self.prev is not None
        gone = copy.deepcopy(self.prev)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        return "DELETED", gone


class RecordedRequest(NamedTuple):
    """One request the stand-in received; ``query`` is the decoded query string."""

    method: str
    path: str
    query: dict[str, str]
    authorization: str | None

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch", "false") in _TRUE


_END = object()  # end the stream cleanly
_CUT = object()  # close the connection without the terminating chunk


@dataclass(eq=False)
class _Watch:
    flt: _Filter
    bookmarks: bool
    queue: asyncio.Queue[Any]


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        status["details"] = details
    return status


def _json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    # Exactly "application/json": lightkube maps HTTP errors to ApiError only for that header value.
    return web.Response(body=json.dumps(body).encode(), status=status, headers={"Content-Type": "application/json"})


def _error(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> web.Response:
    return _json_response(_status(code, reason, message, details), status=code)


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


# ---------------------------------------------------------------------------------------------------------------
# The server


class StandInApiServer:
    """Stand-in for a Kubernetes API server's pod list/watch endpoints; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", *, token: str | None = "stand-in-token") -> None:
        _check_loopback(host, "host")
        self.host = host
        self.token = token
        # Reentrant so wait_until predicates may read the locking properties.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # signalled on every request, mutation and watch open/close
        self._rv = _START_RV
        self._compacted_rv = _START_RV
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._history: list[_Event] = []
        self._snapshots: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self._watches: set[_Watch] = set()
        self._requests: list[RecordedRequest] = []
        self._list_count = 0
        self._watch_count = 0
        self._tokens: set[str] = set() if token is None else {token}
        self._blocked: dict[str, float] = {}  # token -> how long its requests hang before being cut
        self._objects = NamedObjects(self._next_rv)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> StandInApiServer:
        """Serve on a free port of ``host`` from a background thread with its own event loop."""
        if self._thread is not None:
            raise RuntimeError("already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="k8s-stand-in", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._listen(0))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close every connection, stop listening and end the server thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if self._runner is not None:
                self._call(self._unlisten())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None

    def suspend(self) -> None:
        """Stop listening and cut every open connection (watches end abruptly); new connections are refused."""
        if self._runner is None:
            raise RuntimeError("not listening")
        self._call(self._unlisten())

    def resume(self) -> None:
        """Listen again on the same port after ``suspend()``."""
        if self._loop is None or self._port is None:
            raise RuntimeError("not started")
        if self._runner is not None:
            raise RuntimeError("not suspended")
        self._call(self._listen(self._port))

    def __enter__(self) -> StandInApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def suspended(self) -> bool:
        return self._loop is not None and self._runner is None

    def write_kubeconfig(self, path: str | Path, namespace: str = "default", *, token: str | None = None) -> Path:
        """Write a kubeconfig whose current context reaches this server over HTTP; a directory gets ``kubeconfig``.

        ``token``: the client authenticates with a token of its own (accepted from now on), so that
        ``block_token`` can cut that client off alone; by default it presents ``self.token``."""
        target = Path(path)
        if target.is_dir():
            target = target / "kubeconfig"
        if token is not None:
            self.add_token(token)
        token = token if token is not None else self.token
        user: dict[str, Any] = {"token": token} if token is not None else {"username": "stand-in"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "contexts": [
                {"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in", "namespace": namespace}}
            ],
            "users": [{"name": "stand-in", "user": user}],
            "preferences": {},
        }
        target.write_text(yaml.safe_dump(config, sort_keys=False))
        return target

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _listen(self, port: int) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._collection)
        app.router.add_get("/api/v1/pods", self._collection)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", self._get_one)
        app.router.add_route("PATCH", "/api/v1/namespaces/{namespace}/pods/{name}", self._patch_pod)
        for kind, collection in (
            (LEASES, "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"),
            (CONFIGMAPS, "/api/v1/namespaces/{namespace}/configmaps"),
        ):
            app.router.add_post(collection, self._object_handler(kind, "create"))
            for method in ("GET", "PUT", "DELETE"):
                app.router.add_route(method, collection + "/{name}", self._object_handler(kind, method))
        # handler_cancellation: a client that goes away ends its watch at once, so active_watches stays true.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port, reuse_address=True)
        deadline = time.monotonic() + 5
        while True:
            try:
                await site.start()
                break
            except OSError:
                # The port may briefly be held by a socket of ours that is still closing.
                if port == 0 or time.monotonic() > deadline:
                    await runner.cleanup()
                    raise
                await asyncio.sleep(0.05)
        self._runner = runner
        self._port = runner.addresses[0][1]

    async def _unlisten(self) -> None:
        runner, self._runner = self._runner, None
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.queue.put_nowait(_CUT)
        if runner is not None:
            # Closes the listening socket, idle keep-alive connections, then waits for handlers.
            await runner.cleanup()

    # -- state control (any thread) ----------------------------------------------------------------------------

    def add_pod(
        self,
        name: str,
        *,
        ip: str,
        port: int = 30000,
        labels: dict[str, str] | None = None,
        ready: bool = True,
        phase: str = "Running",
        namespace: str = "default",
        image: str = "omni-router/worker:stand-in",
    ) -> dict[str, Any]:
        """Create a pod (ADDED) and return it."""
        _check_loopback(ip, "pod ip")
        labels = dict(labels or {})
        for k, v in labels.items():
            _check_label(k, v)
        if phase not in _PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        pod = _Pod(name, namespace, ip, int(port), labels, ready, phase, image)
        with self._lock:
            if (namespace, name) in self._pods:
                raise ValueError(f'pods "{name}" already exists in namespace {namespace!r}')
            self._pods[(namespace, name)] = pod
            return self._commit(pod, "ADDED", None)

    def set_ready(self, name: str, ready: bool, *, namespace: str = "default") -> dict[str, Any]:
        """Flip the Ready/ContainersReady conditions and the container's ready flag (MODIFIED)."""

        def change(pod: _Pod) -> None:
            if pod.ready != ready:
                pod.ready_changed = _timestamp()
            pod.ready = ready

        return self._modify(namespace, name, change)

    def set_phase(self, name: str, phase: str, *, namespace: str = "default") -> dict[str, Any]:
        """Change ``status.phase`` (MODIFIED); only a Running pod can report Ready=True."""
        if phase not in _PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        return self._modify(namespace, name, lambda pod: setattr(pod, "phase", phase))

    def set_labels(self, name: str, labels: dict[str, str], *, namespace: str = "default") -> dict[str, Any]:
        """Replace the pod's labels (MODIFIED, or ADDED/DELETED for watchers it enters or leaves)."""
        for k, v in labels.items():
            _check_label(k, v)
        return self._modify(namespace, name, lambda pod: setattr(pod, "labels", dict(labels)))

    def mark_terminating(self, name: str, *, namespace: str = "default") -> dict[str, Any]:
        """Set ``deletionTimestamp`` as a graceful delete does (MODIFIED); readiness is left as it was."""

        def change(pod: _Pod) -> None:
            pod.deletion = pod.deletion or _timestamp(time.time() + 30)

        return self._modify(namespace, name, change)

    def delete_pod(self, name: str, *, namespace: str = "default") -> dict[str, Any]:
        """Remove the pod (DELETED, carrying its final state with a new resourceVersion)."""
        with self._lock:
            pod = self._get(namespace, name)
            del self._pods[(namespace, name)]
            return self._commit(pod, "DELETED", pod.obj)

    def compact(self) -> int:
        """Forget the event history; watches from an older version and open continue tokens then get 410."""
        with self._lock:
            self._history.clear()
            self._snapshots.clear()
            self._compacted_rv = self._rv
            return self._rv

    def drop_watches(self, *, graceful: bool = False, timeout: float = 5.0) -> int:
        """End every open watch stream and wait until they are gone; returns how many there were.

        ``graceful=False`` closes the connection mid-stream (as an apiserver restart or a proxy timeout does);
        ``graceful=True`` ends the chunked body properly (as ``timeoutSeconds`` expiry does).
        """
        with self._lock:
            watches = list(self._watches)
            self._send_all(watches, _END if graceful else _CUT)
            deadline = time.monotonic() + timeout
            while any(w in self._watches for w in watches):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"watch streams still open after {timeout}s")
                self._changed.wait(left)
        return len(watches)

    def send_bookmark(self) -> str:
        """Send a BOOKMARK at the current resourceVersion to streams opened with allowWatchBookmarks=true."""
        with self._lock:
            rv = str(self._rv)
            obj = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}
            self._send_all([w for w in self._watches if w.bookmarks], ("BOOKMARK", obj))
            return rv

    def wait_for_watchers(self, n: int = 1, timeout: float = 5.0) -> None:
        """Block until at least ``n`` watch streams are open; TimeoutError otherwise."""
        self.wait_until(lambda: len(self._watches) >= n, timeout, f"{n} open watch streams")

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
        """Block until ``predicate()`` holds; it is re-checked after every request, mutation and watch change."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} within {timeout}s")
                self._changed.wait(left)

    def add_token(self, token: str) -> None:
        """Accept ``token`` as well (each router replica presents its own, so one can be partitioned alone)."""
        with self._lock:
            self._tokens.add(token)

    def block_token(self, token: str, *, hang_s: float = 30.0) -> None:
        """Partition the client presenting ``token``: its requests hang up to ``hang_s``, then are cut unanswered."""
        with self._lock:
            self._blocked[token] = hang_s

    def unblock_token(self, token: str) -> None:
        """End the partition: later requests pass; any still hanging is cut, never answered late."""
        with self._lock:
            self._blocked.pop(token, None)

    # -- observation -------------------------------------------------------------------------------------------

    def lease(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        with self._lock:
            return self._objects.snapshot(LEASES, namespace, name)

    def config_map(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        with self._lock:
            return self._objects.snapshot(CONFIGMAPS, namespace, name)

    def config_maps(self, namespace: str = "default") -> list[str]:
        with self._lock:
            return self._objects.names(CONFIGMAPS, namespace)

    def pods(self, namespace: str = "default") -> list[dict[str, Any]]:
        """Current pods of ``namespace`` by name, as the API server would serve them."""
        with self._lock:
            return [copy.deepcopy(p.obj) for (ns, _), p in sorted(self._pods.items()) if ns == namespace]

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        with self._lock:
            pod = self._pods.get((namespace, name))
            return copy.deepcopy(pod.obj) if pod is not None else None

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def list_count(self) -> int:
        with self._lock:
            return self._list_count

    @property
    def watch_count(self) -> int:
        with self._lock:
            return self._watch_count

    @property
    def active_watches(self) -> int:
        with self._lock:
            return len(self._watches)

    # -- internals (callers hold self._lock) -------------------------------------------------------------------

    def _get(self, namespace: str, name: str) -> _Pod:
        try:
            return self._pods[(namespace, name)]
        except KeyError:
            raise KeyError(f'pods "{name}" not found in namespace {namespace!r}') from None

    def _modify(self, namespace: str, name: str, change: Callable[[_Pod], None]) -> dict[str, Any]:
        with self._lock:
            pod = self._get(namespace, name)
            prev = pod.obj
            change(pod)
            return self._commit(pod, "MODIFIED", prev)

    def _commit(self, pod: _Pod, kind: str, prev: dict[str, Any] | None) -> dict[str, Any]:
        self._rv += 1
        pod.obj = pod.render(self._rv)  # stored objects are never mutated afterwards, so events share them
        event = _Event(self._rv, kind, pod.obj, prev)
        self._history.append(event)
        self._send_all(self._watches, event)
        self._changed.notify_all()
        return copy.deepcopy(pod.obj)

    def _next_rv(self) -> int:
        self._rv += 1
        self._changed.notify_all()
        return self._rv

    def _send_all(self, watches: Iterable[_Watch], item: Any) -> None:
        # Under the lock, so every queue receives events in resourceVersion order.
        loop = self._loop
        if loop is None:
            return
        for w in watches:
            try:
                loop.call_soon_threadsafe(w.queue.put_nowait, item)
            except RuntimeError:  # loop closed while stopping
                return

    # -- HTTP --------------------------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        with self._lock:
            self._requests.append(RecordedRequest(request.method, request.path, dict(request.query), auth))
            self._changed.notify_all()
        token = auth[len("Bearer ") :] if auth is not None and auth.startswith("Bearer ") else None
        if self.token is not None and token not in self._tokens:
            return _error(401, "Unauthorized", "Unauthorized")
        if token is not None and token in self._blocked:
            return await self._partitioned(request, token)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _error(404, "NotFound", "the server could not find the requested resource")
        except web.HTTPMethodNotAllowed:
            return _error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    async def _partitioned(self, request: web.Request, token: str) -> web.StreamResponse:
        """Hang while ``token`` is blocked (at most its ``hang_s``), then cut the connection without an answer."""
        loop = asyncio.get_running_loop()
        with self._lock:
            deadline = loop.time() + self._blocked.get(token, 0.0)
        while loop.time() < deadline:
            with self._lock:
                if token not in self._blocked:
                    break
            await asyncio.sleep(0.02)
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=503)  # never reaches the client: its connection is closed

    def _object_handler(self, kind: Kind, action: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            namespace, name = request.match_info["namespace"], request.match_info.get("name", "")
            body: Any = None
            if request.can_read_body:
                try:
                    body = json.loads(await request.read())
                except ValueError as e:
                    return _error(400, "BadRequest", f"the body of the request was in an unknown format: {e}")
            try:
                with self._lock:
                    if action == "create":
                        return _json_response(self._objects.create(kind, namespace, body), status=201)
                    if action == "GET":
                        return _json_response(self._objects.get(kind, namespace, name))
                    if action == "PUT":
                        return _json_response(self._objects.replace(kind, namespace, name, body))
                    return _json_response(self._objects.delete(kind, namespace, name, body))
            except Refusal as r:
                return _error(r.code, r.reason, r.message, r.details)

        return handle

    async def _get_one(self, request: web.Request) -> web.StreamResponse:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        obj = self.pod(name, namespace)
        if obj is None:
            return _error(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        return _json_response(obj)

    async def _patch_pod(self, request: web.Request) -> web.StreamResponse:
        """A JSON merge patch of the pod's labels (``metadata.labels``; a null value removes one): the one
        change a router makes to a pod (its own role label). Anything else in the patch is refused."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if request.content_type != "application/merge-patch+json":
            return _error(415, "UnsupportedMediaType", f"the stand-in takes merge patches, not {request.content_type}")
        try:
            body = await request.json()
            labels = body["metadata"]["labels"]
            if set(body) != {"metadata"} or set(body["metadata"]) != {"labels"} or not isinstance(labels, dict):
                raise ValueError("only metadata.labels")
            for key, value in labels.items():
                _check_label(key, value)
        except (ValueError, KeyError, TypeError, SelectorError) as exc:
            return _error(422, "Invalid", f"the stand-in patches only a pod's labels: {exc}")

        def change(pod: _Pod) -> None:
            merged = {**pod.labels, **{k: v for k, v in labels.items() if v is not None}}
            pod.labels = {k: v for k, v in merged.items() if labels.get(k, "") is not None}

        try:
            return _json_response(self._modify(namespace, name, change))
        except KeyError:
            return _error(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        try:
            flt = _Filter(
                request.match_info.get("namespace"),
                tuple(parse_label_selector(query.get("labelSelector", ""))),
                tuple(parse_field_selector(query.get("fieldSelector", ""))),
            )
            watch = query.get("watch", "false")
            if watch not in _TRUE | _FALSE:
                raise SelectorError(f"invalid value for watch: {watch!r}")
        except SelectorError as e:
            return _error(400, "BadRequest", str(e))
        if watch in _TRUE:
            return await self._watch(request, flt)
        return self._list(request, flt)

    def _list(self, request: web.Request, flt: _Filter) -> web.Response:
        query = request.query
        with self._lock:
            self._list_count += 1
        try:
            limit = int(query.get("limit", "0") or 0)
            if limit < 0:
                raise ValueError
        except ValueError:
            return _error(400, "BadRequest", f"invalid limit: {query.get('limit')!r}")
        token = query.get("continue", "")
        with self._lock:
            if token:
                try:
                    decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                    rv, start = int(decoded["rv"]), str(decoded["start"])
                except (binascii.Error, ValueError, KeyError, TypeError):
                    return _error(400, "BadRequest", "continue key is not valid: cannot decode the continue token")
                snapshot = self._snapshots.get(rv)
                if snapshot is None:
                    return _error(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. "
                        "You can start a new list without the continue parameter.",
                    )
            else:
                rv, start = self._rv, ""
                snapshot = [p.obj for _, p in sorted(self._pods.items())]
                if limit:
                    self._snapshots[rv] = snapshot
                    while len(self._snapshots) > _MAX_SNAPSHOTS:
                        self._snapshots.popitem(last=False)
        matching = [o for o in snapshot if flt.matches(o) and _key(o) > start]
        page = matching[:limit] if limit else matching
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and len(matching) > limit:
            last = _key(page[-1])
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps({"rv": rv, "start": last}).encode()).decode()
            if not flt.labels and not flt.fields:
                metadata["remainingItemCount"] = len(matching) - limit
        return _json_response({"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page})

    async def _watch(self, request: web.Request, flt: _Filter) -> web.StreamResponse:
        query = request.query
        rv_param = query.get("resourceVersion", "")
        try:
            since = int(rv_param) if rv_param not in ("", "0") else None
            timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        except ValueError:
            return _error(400, "BadRequest", "invalid resourceVersion or timeoutSeconds")
        bookmarks = query.get("allowWatchBookmarks", "false") in _TRUE
        watch = _Watch(flt, bookmarks, asyncio.Queue())
        expired: str | None = None
        with self._lock:
            self._watch_count += 1
            if since is None:
                initial = [("ADDED", p.obj) for _, p in sorted(self._pods.items()) if flt.matches(p.obj)]
            elif since < self._compacted_rv:
                initial = []
                expired = f"too old resource version: {since} ({self._compacted_rv})"
            else:
                initial = [seen for ev in self._history if ev.rv > since and (seen := ev.for_watcher(flt))]
            if expired is None:
                self._watches.add(watch)
                self._changed.notify_all()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            if expired is not None:
                await resp.write(_line("ERROR", _status(410, "Expired", expired)))
                return resp
            for kind, obj in initial:
                await resp.write(_line(kind, obj))
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    return resp
                try:
                    item = await asyncio.wait_for(watch.queue.get(), left)
                except TimeoutError:
                    return resp
                if item is _END:
                    return resp
                if item is _CUT:
                    # No terminating chunk: the client sees the body end mid-stream.
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if isinstance(item, _Event):
                    seen = item.for_watcher(flt)
                    if seen is not None:
                        await resp.write(_line(*seen))
                else:
                    await resp.write(_line(*item))
        except ConnectionError:
            return resp
        finally:
            with self._lock:
                self._watches.discard(watch)
                self._changed.notify_all()


def _key(obj: dict[str, Any]) -> str:
    # (namespace, name) order, as etcd keys sort; NUL cannot appear in either.
    return f"{obj['metadata']['namespace']}\x00{obj['metadata']['name']}"
