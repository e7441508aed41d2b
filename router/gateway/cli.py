"""``omni-router``: parse flags, build the app, serve until stopped."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from router import __version__
from router.contract.errors import ApiError
from router.contract.web.auth import ADMIN_KEY_ENV, resolve_admin_key
from router.gateway.app import create_app
from router.gateway.config import (
    DISCOVERY_NAMES,
    POLICY_NAMES,
    STATE_STORE_NAMES,
    SYNC_JOINERS_NAMES,
    WORKER_ENGINE_NAMES,
    RouterConfig,
)
from router.gateway.discovery.k8s import require_client
from router.gateway.processes.control import DEFAULT_ACK_TIMEOUT_S
from router.gateway.processes.launch import data_plane_count, run_control, run_data_plane
from router.gateway.serving import Hooks, serve, tcp

log = logging.getLogger("router")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the router runs on: uvloop when installed (``auto``; part of the default install on
    CPython outside Windows), else asyncio's own. uvloop's event loop and transports are C: less CPU
    per proxied request (README, Benchmarks). ``None`` means asyncio's default loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog="omni-router",
        description="One URL in front of N inference workers (omni-worker, vLLM, SGLang): routing, admin broadcast, "
        "weight sync.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="TCP port to listen on")
    p.add_argument(
        "--worker-urls", nargs="*", default=[], metavar="URL", help="workers to register at start-up, in rank order"
    )
    p.add_argument(
        "--worker-engine",
        choices=WORKER_ENGINE_NAMES,
        default=d.worker_engine,
        help="the server behind worker URLs that do not say (--worker-urls, POST /workers without engine, pods "
        "without the omni-router.io/engine label): omni, vllm, sglang, or auto (detected at registration)",
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        help=f"bearer key for admin and registry routes; when unset, ${ADMIN_KEY_ENV} is used",
    )
    p.add_argument(
        "--worker-api-key",
        default=None,
        help="the key the router presents to workers (admin calls, metadata); default: the admin key. "
        "Callers' keys are never forwarded",
    )
    p.add_argument("--api-key", default=None, help="bearer key for /generate (the admin key is accepted too)")
    p.add_argument(
        "--policy", choices=POLICY_NAMES, default=d.policy, help="how /generate picks among routable workers"
    )
    _add_session_affinity_flags(p, d)
    p.add_argument(
        "--version-policy",
        default=d.version_policy,
        help="which recorded fleet weight versions /generate may be served from when a request sends no "
        "X-Version-Policy: latest-only (default), max-staleness:K, min-version:V or any",
    )
    p.add_argument(
        "--sync-joiners",
        choices=SYNC_JOINERS_NAMES,
        default=d.sync_joiners,
        help="peer: a worker that joined or restarted after a weight update loads the fleet's weights from a "
        "verified holder (POST /update_weights_from_peer) and then takes traffic; off: it stays pending until "
        "the trainer's next sync",
    )
    p.add_argument(
        "--admin-lock-timeout-s",
        type=float,
        default=d.admin_lock_timeout_s,
        help="seconds an admin update waits for the update lock before answering 503",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="seconds one proxied /generate may take, streaming included",
    )
    p.add_argument(
        "--connect-timeout-s", type=float, default=d.connect_timeout_s, help="seconds to open a connection to a worker"
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="extra /generate attempts on other workers (before the first response byte only)",
    )
    p.add_argument(
        "--health-check-interval-s",
        type=float,
        default=d.health_check_interval_s,
        help="seconds between health probes of each worker (with +-20%% jitter)",
    )
    p.add_argument(
        "--health-check-timeout-s",
        type=float,
        default=d.health_check_timeout_s,
        help="seconds one health probe may take",
    )
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d.health_failure_threshold,
        help="consecutive failed probes that take a healthy worker out of routing",
    )
    p.add_argument(
        "--health-dead-threshold",
        type=int,
        default=None,
        help="consecutive failed probes until a worker is dead (no broadcasts either); default: twice the failure threshold",
    )
    p.add_argument(
        "--health-success-threshold",
        type=int,
        default=d.health_success_threshold,
        help="consecutive good probes that bring an unhealthy or dead worker back",
    )
    p.add_argument(
        "--update-session-timeout-s",
        type=float,
        default=None,
        help="seconds a prepared two-phase update may wait for its complete or abort before the router "
        "fails it closed; default: the prepare's receive window (its timeout_s, else the workers' "
        "default) plus one margin",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=d.shutdown_grace_s,
        help="seconds that requests in flight (streams included) may run to completion after SIGTERM or SIGINT, "
        "once the router stopped accepting connections; the rest are then cancelled and aborted on their workers",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="directory of the durable update journal (keeps a failed update's workers fenced across router restarts)",
    )
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="size of the connection pool to workers"
    )
    p.add_argument(
        "--service-discovery",
        choices=DISCOVERY_NAMES,
        default=d.service_discovery,
        help="static: --worker-urls and POST /workers only; k8s: also the Running, Ready pods matching --selector "
        "(needs omni-router[k8s]; credentials: the pod's service account, else KUBECONFIG, else ~/.kube/config)",
    )
    p.add_argument(
        "--selector",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        type=_label,
        help="labels every worker pod carries, e.g. app=omni-worker",
    )
    p.add_argument(
        "--service-discovery-namespace",
        default=None,
        help="namespace to watch for worker pods; default: the router's own (or the kubeconfig context's)",
    )
    p.add_argument(
        "--service-discovery-port",
        type=int,
        default=None,
        help="worker port on each pod; default: the container port named 'http'",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="auto: uvloop when it is installed, else asyncio's loop",
    )
    p.add_argument(
        "--data-plane-processes",
        default="auto",
        metavar="N|auto",
        help="processes serving the generation routes on --port (SO_REUSEPORT) beside one control process that "
        "owns the registry, health, admin lock and fences; auto: one per usable core (at most 8); 1: one process",
    )
    p.add_argument(
        "--data-plane-ack-timeout-s",
        type=float,
        default=DEFAULT_ACK_TIMEOUT_S,
        help="how long a fenced admin call waits for every data-plane process to apply the fence before it "
        "fails closed (503, nothing sent) and the late process is restarted",
    )
    _add_high_availability_flags(p, d)
    # Set by the control process when it starts a data plane: not for operators.
    p.add_argument("--data-plane-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-plane-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="log line format")
    return p


def _add_session_affinity_flags(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Session affinity (docs/router.md, "Session affinity")."""
    p.add_argument(
        "--session-affinity",
        action="store_true",
        help="pin each session (X-Session-Id, else X-SMG-Routing-Key, else the caller's rid without its _t<n>/_r<n> "
        "suffixes) to one worker by bounded-load rendezvous hashing; requests without a key follow --policy",
    )
    p.add_argument(
        "--session-affinity-ttl-s",
        type=float,
        default=d.session_affinity_ttl_s,
        help="seconds a session's pin outlives its last request",
    )
    p.add_argument(
        "--session-affinity-load-factor",
        type=float,
        default=d.session_affinity_load_factor,
        help="epsilon of the load bound: a new session goes to a worker holding fewer than ceil((1+epsilon)*mean) pins",
    )
    p.add_argument(
        "--session-affinity-max-sessions",
        type=int,
        default=d.session_affinity_max_sessions,
        help="pins kept at most per process; past it the least recently used is forgotten",
    )


def _add_high_availability_flags(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    """State in the Kubernetes API and leader election (docs/router.md, "High availability on Kubernetes")."""
    p.add_argument(
        "--state-store",
        choices=STATE_STORE_NAMES,
        default=None,
        help="where the durable records live: dir (files under --state-dir; the default when it is given) or k8s "
        "(one ConfigMap per record in the router's namespace, read by every replica; needs omni-router[k8s])",
    )
    p.add_argument(
        "--state-configmap-prefix",
        default=d.state_configmap_prefix,
        help="name prefix of the ConfigMaps of --state-store k8s",
    )
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas on Kubernetes: the holder of a coordination.k8s.io Lease serves, the "
        "others stand by (503 to clients) and take over when it stops renewing; needs --state-store k8s",
    )
    p.add_argument("--leader-lease-name", default=d.leader_lease_name, help="the Lease (in the router's namespace)")
    p.add_argument(
        "--leader-lease-duration-s",
        type=float,
        default=d.leader_lease_duration_s,
        help="seconds a standby waits, after it last saw the Lease renewed, before taking it",
    )
    p.add_argument(
        "--leader-renew-deadline-s",
        type=float,
        default=d.leader_renew_deadline_s,
        help="seconds the leader may fail to renew before it steps down and exits (below the lease duration)",
    )
    p.add_argument(
        "--leader-retry-period-s",
        type=float,
        default=d.leader_retry_period_s,
        help="seconds between the leader's renewals and a standby's tries",
    )
    p.add_argument(
        "--leader-pod-label",
        default=d.leader_pod_label,
        metavar="KEY",
        help="set KEY=leader or KEY=standby on this replica's own pod (POD_NAME), so a Service can select the leader "
        "while both replicas are Ready (e.g. omni-router.io/role; needs patch on pods)",
    )


def _kubernetes_flag(config: RouterConfig) -> str | None:
    """The first flag set that needs the k8s extra's client before the app is built, if any."""
    if config.leader_election:
        return "--leader-election"
    if config.state_store == "k8s":
        return "--state-store k8s"
    return None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        worker_urls=list(args.worker_urls),
        worker_engine=args.worker_engine,
        admin_api_key=resolve_admin_key(args.admin_api_key),
        worker_api_key=args.worker_api_key or None,
        api_key=args.api_key or None,
        policy=args.policy,
        version_policy=args.version_policy,
        session_affinity=args.session_affinity,
        session_affinity_ttl_s=args.session_affinity_ttl_s,
        session_affinity_load_factor=args.session_affinity_load_factor,
        session_affinity_max_sessions=args.session_affinity_max_sessions,
        sync_joiners=args.sync_joiners,
        admin_lock_timeout_s=args.admin_lock_timeout_s,
        request_timeout_s=args.request_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        max_retries=args.max_retries,
        health_check_interval_s=args.health_check_interval_s,
        health_check_timeout_s=args.health_check_timeout_s,
        health_failure_threshold=args.health_failure_threshold,
        health_dead_threshold=args.health_dead_threshold,
        health_success_threshold=args.health_success_threshold,
        update_session_timeout_s=args.update_session_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
        state_dir=args.state_dir,
        max_connections=args.max_connections,
        service_discovery=args.service_discovery,
        selector=dict(args.selector),
        discovery_namespace=args.service_discovery_namespace,
        discovery_port=args.service_discovery_port,
        state_store=args.state_store,
        state_configmap_prefix=args.state_configmap_prefix,
        leader_election=args.leader_election,
        leader_lease_name=args.leader_lease_name,
        leader_lease_duration_s=args.leader_lease_duration_s,
        leader_renew_deadline_s=args.leader_renew_deadline_s,
        leader_retry_period_s=args.leader_retry_period_s,
        leader_pod_label=args.leader_pod_label or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    config = config_from_args(args)
    if not config.shutdown_grace_s >= 0:
        log.error("cannot start: --shutdown-grace-s must be >= 0, got %s", config.shutdown_grace_s)
        return 2
    try:
        loop_factory = event_loop_factory(args.event_loop)
        processes = data_plane_count(args.data_plane_processes)
    except (RuntimeError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    if args.data_plane_of is not None:  # started by a control process: serve its generation routes
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(
                run_data_plane(
                    config, socket_path=args.data_plane_of, index=args.data_plane_index, host=args.host, port=args.port
                )
            )
        return 0
    k8s_flag = _kubernetes_flag(config)
    if k8s_flag is not None:
        try:  # the state store and the election are built with the app: refuse before, in one line
            require_client(k8s_flag)
        except RuntimeError as exc:
            log.error("cannot start: %s", exc)
            return 2
    if processes > 1 and args.port == 0:
        if args.data_plane_processes == "auto":  # an OS-chosen port cannot be shared: one process
            processes = 1
        else:
            log.error(
                "cannot start: --data-plane-processes %d needs a fixed --port (every process binds it)", processes
            )
            return 2
    try:
        app = create_app(config)
    except (ValueError, ApiError) as exc:  # bad flags or worker URLs: say which, exit non-zero
        log.error("cannot start: %s", getattr(exc, "message", exc))
        return 2
    if config.service_discovery == "k8s":
        try:  # without the Kubernetes client the router would serve with no discovered workers: refuse
            require_client()
        except RuntimeError as exc:
            log.error("cannot start: %s", exc)
            return 2
    if config.effective_state_store is None:
        log.warning("no --state-dir: a router crash mid-update cannot keep its targets disabled across restarts")
    started = time.monotonic()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        if processes > 1:
            runner.run(
                run_control(
                    app,
                    config,
                    argv,
                    count=processes,
                    host=args.host,
                    port=args.port,
                    ack_timeout_s=args.data_plane_ack_timeout_s,
                )
            )
        else:
            runner.run(serve(app, tcp(args.host, args.port), config.shutdown_grace_s, Hooks(on_started=_ready(config))))
    log.info("omni-router stopped after %.0fs", time.monotonic() - started)
    return 0


def _ready(config: RouterConfig) -> Callable[[list[str]], None]:
    def say(addresses: list[str]) -> None:
        log.info(
            "omni-router ready on %s workers=%d policy=%s admin_auth=%s state_dir=%s discovery=%s loop=%s",
            ", ".join(addresses),
            len(config.worker_urls),
            config.policy,
            "on" if config.admin_api_key else "off",
            config.state_dir,
            config.service_discovery,
            type(asyncio.get_running_loop()).__module__.partition(".")[0],
        )

    return say


if __name__ == "__main__":
    sys.exit(main())
