"""Router settings: one typed dataclass, filled by the CLI or by tests."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from router.contract.budget import DEFAULT_LOCK_WAIT_S
from router.contract.fleet import EngineName
from router.gateway.routing.versions import parse_version_policy

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


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """Everything ``create_app`` needs; defaults are the CLI defaults."""

    worker_urls: list[str] = field(default_factory=list)
    """Workers registered at start-up, in order (their order fixes rank assignment)."""

    worker_engine: WorkerEngineName = "auto"
    """The server behind each worker URL that does not say (``--worker-urls``, ``POST /workers`` without
    ``engine``, discovered pods without the ``omni-router.io/engine`` label): ``omni``, ``vllm``, ``sglang``,
    or ``auto``, detected at registration (docs/engines.md)."""

    admin_api_key: str | None = None
    """Bearer key for every admin and registry route."""

    worker_api_key: str | None = None
    """The key the router presents to workers (admin calls, metadata reads); ``None``: the admin key.
    A caller's own key is never forwarded, so it cannot reach a URL someone registered."""

    api_key: str | None = None
    """Optional bearer key for ``/generate`` (the admin key is accepted too)."""

    policy: PolicyName = "least_inflight"
    """How ``/generate`` picks among routable workers."""

    session_affinity: bool = False
    """Pin each session (``X-Session-Id``, ``X-SMG-Routing-Key`` or a caller's ``rid`` lineage) to one
    worker, so a multi-turn rollout reuses its prefix cache; requests without a key follow ``policy``."""

    session_affinity_ttl_s: float = 600.0
    """How long a pin outlives its session's last request."""

    session_affinity_load_factor: float = 0.25
    """ε of the load bound: a new session goes to a worker holding fewer than ceil((1+ε)·mean) pins."""

    session_affinity_max_sessions: int = 100_000
    """Pins kept at most; past it the least recently used is forgotten."""

    version_policy: str = "latest-only"
    """Which recorded fleet versions a generation request may be served from when it names none
    (``X-Version-Policy``): ``latest-only``, ``max-staleness:K``, ``min-version:V`` or ``any``."""

    sync_joiners: SyncJoinersName = "peer"
    """``peer``: a worker pending because it has not received the fleet's weights (joined or restarted since
    the last weight change) loads them from a verified holder, then takes traffic; ``off``: it waits for the
    trainer's next sync."""

    admin_lock_timeout_s: float = DEFAULT_LOCK_WAIT_S
    """How long an admin update waits for the update lock before answering 503."""

    request_timeout_s: float = 1800.0
    """Upper bound on one proxied ``/generate`` call, streaming included."""

    connect_timeout_s: float = 5.0
    """Bound on opening a connection to a worker (also ends a dead worker's retry quickly)."""

    max_retries: int = 2
    """Extra attempts for ``/generate`` on another worker, only before the first response byte."""

    retry_initial_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0

    health_check_interval_s: float = 10.0
    health_check_timeout_s: float = 5.0
    health_failure_threshold: int = 3
    """Consecutive failed probes that take a healthy worker out of routing (unhealthy)."""

    health_dead_threshold: int | None = None
    """Consecutive failed probes after which a worker is dead (no traffic, no broadcasts).
    ``None`` means twice the failure threshold."""

    health_success_threshold: int = 2
    """Consecutive good probes that bring an unhealthy or dead worker back."""

    update_session_timeout_s: float | None = None
    """Life of a prepared two-phase update (ready prepare to its complete or abort); past it
    the router fails the update closed. ``None``: the prepare's receive window (its
    ``timeout_s``, else the workers' default) plus one margin of the timeout budget."""

    shutdown_grace_s: float = 30.0
    """On SIGTERM or SIGINT: how long requests in flight (streams included) may run to completion
    after the router stopped accepting connections; what is still running then is cancelled
    (and aborted on its worker). Keep it below Kubernetes' ``terminationGracePeriodSeconds``."""

    state_dir: Path | None = None
    """Where the update journal lives. ``None``: in-memory only (no crash safety)."""

    max_connections: int = 1024
    """Size of the shared connection pool; admitted calls should not wait inside it."""

    service_discovery: DiscoveryName = "static"
    """``static``: only ``worker_urls`` and ``POST /workers``; ``k8s``: also the pods that match ``selector``."""

    selector: dict[str, str] = field(default_factory=dict)
    """Pod labels a worker pod carries (every one must match)."""

    discovery_namespace: str | None = None
    """Namespace to watch; ``None``: the client configuration's (the pod's own inside a cluster)."""

    discovery_port: int | None = None
    """Worker port on each pod; ``None``: the container port named ``http``."""

    # -- High availability on Kubernetes (docs/router.md): where durable records live, leader election.

    state_store: StateStoreName | None = None
    """``dir``: files under ``state_dir``; ``k8s``: one ConfigMap per record in the router's namespace,
    which every replica reads. ``None``: ``dir`` when ``state_dir`` is set, else memory only."""

    state_configmap_prefix: str = "omni-router-state"
    """ConfigMap names of ``k8s`` records: ``<prefix>-<record>``."""

    leader_election: bool = False
    """Run as one of several replicas: the one holding the Lease serves, the others stand by."""

    leader_lease_name: str = "omni-router-leader"
    leader_lease_duration_s: float = 15.0
    """How long a standby waits, after it last saw the Lease renewed, before it takes it."""
    leader_renew_deadline_s: float = 10.0
    """How long the leader may fail to renew before it steps down (below the lease duration)."""
    leader_retry_period_s: float = 2.0
    """How often the leader renews and a standby tries."""
    leader_identity: str | None = None
    """This replica in the election; ``None``: ``POD_NAME``, else ``<hostname>_<pid>``."""
    leader_pod_label: str | None = None
    """A label key the replica sets on its own pod (named by its identity) to ``leader`` or ``standby``,
    for a Service that selects the leader while both replicas are Ready (:mod:`router.gateway.leader.pod_label`)."""

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

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        positive = {
            "admin_lock_timeout_s": self.admin_lock_timeout_s,
            "request_timeout_s": self.request_timeout_s,
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
        if self.sync_joiners not in SYNC_JOINERS_NAMES:
            raise ValueError(f"unknown --sync-joiners {self.sync_joiners!r}")
        if self.service_discovery not in DISCOVERY_NAMES:
            raise ValueError(f"unknown service discovery {self.service_discovery!r}")
        if self.service_discovery == "k8s" and not self.selector:
            raise ValueError("--service-discovery k8s needs --selector k=v (which pods are workers)")
        if self.discovery_port is not None and not 1 <= self.discovery_port <= 65535:
            raise ValueError(f"discovery_port must be a TCP port, got {self.discovery_port}")
        self._validate_high_availability()
