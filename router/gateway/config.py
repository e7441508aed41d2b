"""Router settings: one typed dataclass, filled by the CLI (its flags are declared here) or by tests."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, get_args

from router.contract.budget import DEFAULT_LOCK_WAIT_S
from router.contract.fleet import EngineName
from router.contract.settings import Flag, key_value
from router.contract.version_policy import parse_version_policy
from router.contract.web.auth import ADMIN_KEY_ENV
from router.contract.web.parsing import MAX_BODY_BYTES
from router.contract.weight_digest import VerifyUpdates

PolicyName = Literal["least_inflight", "round_robin", "random"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
DiscoveryName = Literal["static", "k8s"]
DISCOVERY_NAMES: tuple[str, ...] = get_args(DiscoveryName)
StateStoreName = Literal["dir", "k8s"]
STATE_STORE_NAMES: tuple[str, ...] = get_args(StateStoreName)
SyncJoinersName = Literal["peer", "off"]
SYNC_JOINERS_NAMES: tuple[str, ...] = get_args(SyncJoinersName)
WorkerEngineName = Literal["auto", "omni", "vllm", "sglang"]
WORKER_ENGINE_NAMES: tuple[str, ...] = get_args(WorkerEngineName)

#: The router's default body budget (:mod:`router.gateway.frontend.budget`), shared by its serving processes:
#: sixteen bodies of the largest size.
DEFAULT_ROUTER_BUDGET_BYTES = 16 * MAX_BODY_BYTES
#: Each serving process may hold at least this much, so two of the largest bodies always fit.
MIN_PROCESS_BUDGET_BYTES = 2 * MAX_BODY_BYTES


def process_share(router_budget_bytes: int | None, processes: int) -> int:
    """One serving process's share of the router's body budget (the default when ``None``)."""
    total = DEFAULT_ROUTER_BUDGET_BYTES if router_budget_bytes is None else router_budget_bytes
    return max(MIN_PROCESS_BUDGET_BYTES, total // max(1, processes))


def worker_floor(text: str) -> float:
    """``--min-routable-workers``: a whole number of workers (``3``, also ``3.0``), or a share of the fleet
    below 1 (``0.75``); ``0`` is off. A share of 1 is not taken: ``1`` is one worker."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0) or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of workers (3) or a share of them below 1 (0.75), got {text!r}"
        )
    return value if 0 < value < 1 else int(value)


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """Everything ``create_app`` needs. A field annotated with a :class:`~router.contract.settings.Flag` is an
    ``omni-router`` flag, with the field's default (:mod:`router.contract.settings`)."""

    worker_urls: Annotated[
        list[str], Flag("workers to register at start-up, in rank order", nargs="*", metavar="URL")
    ] = field(default_factory=list)
    worker_engine: Annotated[
        WorkerEngineName,
        Flag(
            "the server behind worker URLs that do not say (--worker-urls, POST /workers without engine, pods without "
            "the omni-router.io/engine label): omni, vllm, sglang, or auto (detected at registration; docs/engines.md)"
        ),
    ] = "auto"
    admin_api_key: Annotated[str | None, Flag("bearer key for admin and registry routes", env=ADMIN_KEY_ENV)] = None
    worker_api_key: Annotated[
        str | None,
        Flag(
            "the key the router presents to workers (admin calls, metadata); default: the admin key. Callers' keys "
            "are never forwarded, so they cannot reach a URL someone registered",
            empty_is_unset=True,
        ),
    ] = None
    api_key: Annotated[
        str | None, Flag("bearer key for /generate (the admin key is accepted too)", empty_is_unset=True)
    ] = None
    policy: Annotated[PolicyName, Flag("how /generate picks among routable workers")] = "least_inflight"

    # -- Session affinity (docs/router.md, "Session affinity").
    session_affinity: Annotated[
        bool,
        Flag(
            "pin each session (X-Session-Id, else X-SMG-Routing-Key, else the caller's rid without its _t<n>/_r<n> "
            "suffixes) to one worker by bounded-load rendezvous hashing, so a multi-turn rollout reuses its prefix "
            "cache; requests without a key follow --policy"
        ),
    ] = False
    session_affinity_ttl_s: Annotated[float, Flag("seconds a session's pin outlives its last request")] = 600.0
    session_affinity_load_factor: Annotated[
        float,
        Flag(
            "epsilon of the load bound: a new session goes to a worker holding fewer than ceil((1+epsilon)*mean) pins"
        ),
    ] = 0.25
    session_affinity_max_sessions: Annotated[
        int, Flag("pins kept at most per process; past it the least recently used is forgotten")
    ] = 100_000

    version_policy: Annotated[
        str,
        Flag(
            "which recorded fleet weight versions /generate may be served from when a request sends no "
            "X-Version-Policy: latest-only, max-staleness:K, min-version:V or any"
        ),
    ] = "latest-only"
    verify_updates: Annotated[
        VerifyUpdates,
        Flag(
            "changed: read every target's weights' digest before and after each update that brings new tensors "
            "(from disk, from tensors, over a group, complete, finish, collective_rpc) and fail, fenced, every "
            "target whose weights did not change (a caller expecting that sends X-Expected-Weights-Change: "
            "unchanged); it hashes the weights twice per update (docs/weight-sync.md)"
        ),
    ] = "off"
    sync_joiners: Annotated[
        SyncJoinersName,
        Flag(
            "peer: a worker pending because it has not received the fleet's weights (it joined or restarted after a "
            "weight update) loads them from a verified holder (POST /update_weights_from_peer) and then takes "
            "traffic; off: it stays pending until the trainer's next sync"
        ),
    ] = "peer"
    min_routable_workers: Annotated[
        float,
        Flag(
            "refuse (409, before the update lock, changing nothing) a weight sync that would leave fewer workers "
            "serving the new weights than this: N (a whole number of workers) or a share below 1 of the registered "
            "workers, rounded up (0.75); only healthy, enabled targets that no catch-up is repairing count; 0: off "
            "(docs/router.md)",
            parse=worker_floor,
            metavar="N|SHARE",
        ),
    ] = 0
    max_rejoin_attempts: Annotated[
        int | None,
        Flag(
            "failed catch-ups (--sync-joiners peer) after which the router stops retrying one worker process: it "
            "stays pending, out of routing, its catch_up retired until it restarts (a new instance id); default: "
            "retry without end, with the usual back-off"
        ),
    ] = None
    lora_keep_versions: Annotated[
        int,
        Flag(
            "versions of one LoRA adapter loaded as name@version kept on the workers once a newer one is published; "
            "older ones are unloaded fleet-wide once no request in flight names them, so at most N + 1 are resident "
            "(docs/lora.md)",
            metavar="N",
        ),
    ] = 2
    admin_lock_timeout_s: Annotated[
        float, Flag("seconds an admin update waits for the update lock before answering 503")
    ] = DEFAULT_LOCK_WAIT_S
    request_timeout_s: Annotated[float, Flag("seconds one proxied /generate may take, streaming included")] = 1800.0
    stream_stall_timeout_s: Annotated[
        float,
        Flag(
            "seconds an answer may wait on a caller that reads none of it; then its connection is cut and a "
            "streamed request aborted on its worker (omni_router_stalled_callers_total)"
        ),
    ] = 60.0
    body_budget_mb: Annotated[
        int | None,
        Flag(
            "MiB of generation request bodies the router holds in memory at once, shared equally by its serving "
            "processes (each at least two bodies of the 64 MiB bound); past it a request is answered 503 with "
            "Retry-After; default: 16 bodies (1024)"
        ),
    ] = None
    generation_processes: int = 1
    """Processes serving the generation routes, which share the body budget (set from --data-plane-processes)."""
    connect_timeout_s: Annotated[
        float, Flag("seconds to open a connection to a worker (also ends a dead worker's retry quickly)")
    ] = 5.0
    max_retries: Annotated[
        int, Flag("extra /generate attempts on other workers (before the first response byte only)")
    ] = 2
    retry_initial_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0

    health_check_interval_s: Annotated[
        float, Flag("seconds between health probes of each worker (with +-20% jitter)")
    ] = 10.0
    health_check_timeout_s: Annotated[float, Flag("seconds one health probe may take")] = 5.0
    health_failure_threshold: Annotated[
        int, Flag("consecutive failed probes that take a healthy worker out of routing (unhealthy)")
    ] = 3
    health_dead_threshold: Annotated[
        int | None,
        Flag(
            "consecutive failed probes until a worker is dead (no traffic, no broadcasts either); default: twice "
            "the failure threshold"
        ),
    ] = None
    health_success_threshold: Annotated[
        int, Flag("consecutive good probes that bring an unhealthy or dead worker back")
    ] = 2
    update_session_timeout_s: Annotated[
        float | None,
        Flag(
            "seconds a prepared two-phase update may wait for its complete or abort before the router fails it "
            "closed; default: the prepare's receive window (its timeout_s, else the workers' default) plus one "
            "margin of the timeout budget"
        ),
    ] = None
    shutdown_grace_s: Annotated[
        float,
        Flag(
            "seconds that requests in flight (streams included) may run to completion after SIGTERM or SIGINT, once "
            "the router stopped accepting connections; the rest are then cancelled and aborted on their workers. "
            "Keep it below Kubernetes' terminationGracePeriodSeconds"
        ),
    ] = 30.0
    state_dir: Annotated[
        Path | None,
        Flag(
            "directory of the durable update journal (keeps a failed update's workers fenced across router "
            "restarts); default: memory only, no crash safety"
        ),
    ] = None
    max_connections: Annotated[
        int, Flag("size of the connection pool to workers; admitted calls should not wait inside it")
    ] = 1024

    # -- Service discovery (docs/router.md, "Service discovery").
    service_discovery: Annotated[
        DiscoveryName,
        Flag(
            "static: --worker-urls and POST /workers only; k8s: also the Running, Ready pods matching --selector "
            "(needs omni-router[k8s]; credentials: the pod's service account, else KUBECONFIG, else ~/.kube/config)"
        ),
    ] = "static"
    selector: Annotated[
        dict[str, str],
        Flag(
            "labels every worker pod carries (every one must match), e.g. app=omni-worker",
            nargs="+",
            metavar="KEY=VALUE",
            parse=key_value,
        ),
    ] = field(default_factory=dict)
    discovery_namespace: Annotated[
        str | None,
        Flag(
            "namespace to watch for worker pods; default: the router's own (or the kubeconfig context's)",
            name="--service-discovery-namespace",
        ),
    ] = None
    discovery_port: Annotated[
        int | None,
        Flag("worker port on each pod; default: the container port named 'http'", name="--service-discovery-port"),
    ] = None

    # -- High availability on Kubernetes (docs/router.md): where durable records live, leader election.
    state_store: Annotated[
        StateStoreName | None,
        Flag(
            "where the durable records live: dir (files under --state-dir; the default when it is given) or k8s "
            "(one ConfigMap per record in the router's namespace, read by every replica; needs omni-router[k8s])"
        ),
    ] = None
    state_configmap_prefix: Annotated[
        str, Flag("name prefix of the ConfigMaps of --state-store k8s (<prefix>-<record>)")
    ] = "omni-router-state"
    leader_election: Annotated[
        bool,
        Flag(
            "run as one of several replicas on Kubernetes: the holder of a coordination.k8s.io Lease serves, the "
            "others stand by (503 to clients) and take over when it stops renewing; needs --state-store k8s"
        ),
    ] = False
    leader_lease_name: Annotated[str, Flag("the Lease (in the router's namespace)")] = "omni-router-leader"
    leader_lease_duration_s: Annotated[
        float, Flag("seconds a standby waits, after it last saw the Lease renewed, before taking it")
    ] = 15.0
    leader_renew_deadline_s: Annotated[
        float, Flag("seconds the leader may fail to renew before it steps down and exits (below the lease duration)")
    ] = 10.0
    leader_retry_period_s: Annotated[float, Flag("seconds between the leader's renewals and a standby's tries")] = 2.0
    leader_identity: str | None = None
    """This replica in the election; ``None``: ``POD_NAME``, else ``<hostname>_<pid>``."""
    leader_pod_label: Annotated[
        str | None,
        Flag(
            "set KEY=leader or KEY=standby on this replica's own pod (POD_NAME), so a Service can select the leader "
            "while both replicas are Ready (e.g. omni-router.io/role; needs patch on pods)",
            metavar="KEY",
            empty_is_unset=True,
        ),
    ] = None

    @property
    def effective_state_store(self) -> StateStoreName | None:
        if self.state_store is not None:
            return self.state_store
        return "dir" if self.state_dir is not None else None

    def _validate_high_availability(self) -> None:
        if self.state_store is not None and self.state_store not in STATE_STORE_NAMES:
            raise ValueError(f"unknown state store {self.state_store!r}")
        if self.state_store == "dir" and self.state_dir is None:
            raise ValueError("--state-store dir needs --state-dir")
        if self.state_store == "k8s" and self.state_dir is not None:
            raise ValueError("--state-dir is the dir store's; --state-store k8s keeps records in ConfigMaps")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.state_configmap_prefix):
            raise ValueError(f"state_configmap_prefix must be a DNS label, got {self.state_configmap_prefix!r}")
        if self.leader_pod_label is not None and not self.leader_election:
            raise ValueError("--leader-pod-label needs --leader-election")
        if self.leader_pod_label is not None and not re.fullmatch(
            r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", self.leader_pod_label
        ):
            raise ValueError(f"--leader-pod-label must be a label key, got {self.leader_pod_label!r}")
        if not self.leader_election:
            return
        if self.state_store != "k8s":
            raise ValueError("--leader-election needs --state-store k8s (a new leader reads what the last one wrote)")
        lease, renew, retry = self.leader_lease_duration_s, self.leader_renew_deadline_s, self.leader_retry_period_s
        if not lease > renew > retry > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0 (the leader must give up "
                f"before a standby may take over), got {lease} / {renew} / {retry}"
            )

    @property
    def fixed_engine(self) -> EngineName | None:
        """The engine workers are registered with when they name none; ``None``: detected."""
        return None if self.worker_engine == "auto" else self.worker_engine

    @property
    def key_for_workers(self) -> str | None:
        return self.worker_api_key if self.worker_api_key is not None else self.admin_api_key

    @property
    def dead_threshold(self) -> int:
        if self.health_dead_threshold is not None:
            return max(self.health_dead_threshold, self.health_failure_threshold)
        return 2 * self.health_failure_threshold

    def body_budget_bytes(self) -> int:
        """This process's share of the router's body budget (:func:`process_share`)."""
        total = None if self.body_budget_mb is None else self.body_budget_mb * 1024 * 1024
        return process_share(total, self.generation_processes)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        positive = {
            "admin_lock_timeout_s": self.admin_lock_timeout_s,
            "request_timeout_s": self.request_timeout_s,
            "stream_stall_timeout_s": self.stream_stall_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "health_check_interval_s": self.health_check_interval_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.update_session_timeout_s is not None:
            positive["update_session_timeout_s"] = self.update_session_timeout_s
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("health_failure_threshold", "health_success_threshold", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.body_budget_mb is not None and self.body_budget_mb < 1:
            raise ValueError(f"body_budget_mb must be >= 1, got {self.body_budget_mb}")
        if self.max_rejoin_attempts is not None and self.max_rejoin_attempts < 1:
            raise ValueError(f"--max-rejoin-attempts must be >= 1, got {self.max_rejoin_attempts}")
        if self.lora_keep_versions < 1:
            raise ValueError(f"--lora-keep-versions must be >= 1, got {self.lora_keep_versions}")
        try:
            worker_floor(str(self.min_routable_workers))  # a config built in code meets the flag's rule
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--min-routable-workers: {exc}") from None
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not self.session_affinity_ttl_s > 0:
            raise ValueError(f"session_affinity_ttl_s must be > 0, got {self.session_affinity_ttl_s}")
        if not self.session_affinity_load_factor >= 0:
            raise ValueError(f"session_affinity_load_factor must be >= 0, got {self.session_affinity_load_factor}")
        if self.session_affinity_max_sessions < 1:
            raise ValueError(f"session_affinity_max_sessions must be >= 1, got {self.session_affinity_max_sessions}")
        parse_version_policy(self.version_policy)
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}")
        if self.worker_engine not in WORKER_ENGINE_NAMES:
            raise ValueError(f"unknown --worker-engine {self.worker_engine!r}")
        if self.verify_updates not in get_args(VerifyUpdates):
            raise ValueError(f"unknown --verify-updates {self.verify_updates!r}")
        if self.sync_joiners not in SYNC_JOINERS_NAMES:
            raise ValueError(f"unknown --sync-joiners {self.sync_joiners!r}")
        if self.service_discovery not in DISCOVERY_NAMES:
            raise ValueError(f"unknown service discovery {self.service_discovery!r}")
        if self.service_discovery == "k8s" and not self.selector:
            raise ValueError("--service-discovery k8s needs --selector k=v (which pods are workers)")
        if self.discovery_port is not None and not 1 <= self.discovery_port <= 65535:
            raise ValueError(f"discovery_port must be a TCP port, got {self.discovery_port}")
        self._validate_high_availability()
