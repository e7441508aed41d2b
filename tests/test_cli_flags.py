"""The command lines of ``omni-router`` and ``omni-worker`` keep their meaning.

Both parsers are built from the settings' dataclasses (:mod:`router.contract.settings`). Users'
command lines, the manifests in deploy/, the demo, the benchmarks and the tests start these
programs with these flags, so every flag's option strings, namespace attribute, default, type,
choices, nargs, const and required are written out below as the parsers had them when they were
written by hand, and command lines that use every flag are parsed into configs written out in full.
Only the help wording may change (and the two parse functions' names, which moved with their flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Annotated, Any

import pytest

from router.contract.settings import Flag, add_flags, from_args
from router.contract.web.auth import ADMIN_KEY_ENV
from router.gateway import cli as router_cli
from router.gateway.cli import ProcessSettings
from router.gateway.config import RouterConfig
from worker import cli as worker_cli
from worker.config import WorkerConfig

Row = tuple[Any, ...]
"""(option strings, dest, default, type, choices, nargs, const, required, metavar) of one flag."""

ROUTER_FLAGS: list[Row] = [
    ("--version", "version", "==SUPPRESS==", None, None, 0, None, False, None),
    ("--host", "host", "127.0.0.1", None, None, None, None, False, None),
    ("--port", "port", 30000, "int", None, None, None, False, None),
    ("--worker-urls", "worker_urls", [], None, None, "*", None, False, "URL"),
    ("--worker-engine", "worker_engine", "auto", None, ("auto", "omni", "vllm", "sglang"), None, None, False, None),
    ("--admin-api-key", "admin_api_key", None, None, None, None, None, False, None),
    ("--worker-api-key", "worker_api_key", None, None, None, None, None, False, None),
    ("--api-key", "api_key", None, None, None, None, None, False, None),
    (
        "--policy",
        "policy",
        "least_inflight",
        None,
        ("least_inflight", "round_robin", "random"),
        None,
        None,
        False,
        None,
    ),
    ("--session-affinity", "session_affinity", False, None, None, 0, True, False, None),
    ("--session-affinity-ttl-s", "session_affinity_ttl_s", 600.0, "float", None, None, None, False, None),
    ("--session-affinity-load-factor", "session_affinity_load_factor", 0.25, "float", None, None, None, False, None),
    ("--session-affinity-max-sessions", "session_affinity_max_sessions", 100000, "int", None, None, None, False, None),
    ("--version-policy", "version_policy", "latest-only", None, None, None, None, False, None),
    ("--verify-updates", "verify_updates", "off", None, ("off", "changed"), None, None, False, None),
    ("--sync-joiners", "sync_joiners", "peer", None, ("peer", "off"), None, None, False, None),
    ("--min-routable-workers", "min_routable_workers", 0, "worker_floor", None, None, None, False, "N|SHARE"),
    ("--max-rejoin-attempts", "max_rejoin_attempts", None, "int", None, None, None, False, None),
    ("--lora-keep-versions", "lora_keep_versions", 2, "int", None, None, None, False, "N"),
    ("--admin-lock-timeout-s", "admin_lock_timeout_s", 300.0, "float", None, None, None, False, None),
    ("--request-timeout-s", "request_timeout_s", 1800.0, "float", None, None, None, False, None),
    ("--stream-stall-timeout-s", "stream_stall_timeout_s", 60.0, "float", None, None, None, False, None),
    ("--body-budget-mb", "body_budget_mb", None, "int", None, None, None, False, None),
    ("--connect-timeout-s", "connect_timeout_s", 5.0, "float", None, None, None, False, None),
    ("--max-retries", "max_retries", 2, "int", None, None, None, False, None),
    ("--health-check-interval-s", "health_check_interval_s", 10.0, "float", None, None, None, False, None),
    ("--health-check-timeout-s", "health_check_timeout_s", 5.0, "float", None, None, None, False, None),
    ("--health-failure-threshold", "health_failure_threshold", 3, "int", None, None, None, False, None),
    ("--health-dead-threshold", "health_dead_threshold", None, "int", None, None, None, False, None),
    ("--health-success-threshold", "health_success_threshold", 2, "int", None, None, None, False, None),
    ("--update-session-timeout-s", "update_session_timeout_s", None, "float", None, None, None, False, None),
    ("--shutdown-grace-s", "shutdown_grace_s", 30.0, "float", None, None, None, False, None),
    ("--state-dir", "state_dir", None, "Path", None, None, None, False, None),
    ("--max-connections", "max_connections", 1024, "int", None, None, None, False, None),
    ("--service-discovery", "service_discovery", "static", None, ("static", "k8s"), None, None, False, None),
    ("--selector", "selector", [], "key_value", None, "+", None, False, "KEY=VALUE"),
    ("--service-discovery-namespace", "service_discovery_namespace", None, None, None, None, None, False, None),
    ("--service-discovery-port", "service_discovery_port", None, "int", None, None, None, False, None),
    ("--event-loop", "event_loop", "auto", None, ("auto", "uvloop", "asyncio"), None, None, False, None),
    ("--data-plane-processes", "data_plane_processes", "auto", None, None, None, None, False, "N|auto"),
    ("--generation-server", "generation_server", "lean", None, ("lean", "aiohttp"), None, None, False, None),
    ("--data-plane-ack-timeout-s", "data_plane_ack_timeout_s", 5.0, "float", None, None, None, False, None),
    ("--state-store", "state_store", None, None, ("dir", "k8s"), None, None, False, None),
    ("--state-configmap-prefix", "state_configmap_prefix", "omni-router-state", None, None, None, None, False, None),
    ("--leader-election", "leader_election", False, None, None, 0, True, False, None),
    ("--leader-lease-name", "leader_lease_name", "omni-router-leader", None, None, None, None, False, None),
    ("--leader-lease-duration-s", "leader_lease_duration_s", 15.0, "float", None, None, None, False, None),
    ("--leader-renew-deadline-s", "leader_renew_deadline_s", 10.0, "float", None, None, None, False, None),
    ("--leader-retry-period-s", "leader_retry_period_s", 2.0, "float", None, None, None, False, None),
    ("--leader-pod-label", "leader_pod_label", None, None, None, None, None, False, "KEY"),
    ("--data-plane-of", "data_plane_of", None, None, None, None, None, False, None),
    ("--data-plane-index", "data_plane_index", 0, "int", None, None, None, False, None),
    ("--log-level", "log_level", "info", None, ("debug", "info", "warning", "error"), None, None, False, None),
    ("--log-format", "log_format", "text", None, ("text", "json"), None, None, False, None),
]

WORKER_FLAGS: list[Row] = [
    ("--version", "version", "==SUPPRESS==", None, None, 0, None, False, None),
    ("--model-path", "model_path", None, None, None, None, None, True, None),
    ("--host", "host", "127.0.0.1", None, None, None, None, False, None),
    ("--port", "port", 30000, "int", None, None, None, False, None),
    ("--device", "device", "cpu", None, None, None, None, False, None),
    ("--dtype", "dtype", "float32", None, ("float32", "bfloat16"), None, None, False, None),
    ("--admin-api-key", "admin_api_key", None, None, None, None, None, False, None),
    ("--api-key", "api_key", None, None, None, None, None, False, None),
    ("--max-running-requests", "max_running_requests", 32, "int", None, None, None, False, None),
    ("--num-threads", "num_threads", None, "int", None, None, None, False, None),
    ("--served-model-name", "served_model_name", None, None, None, None, None, False, None),
    ("--log-level", "log_level", "info", None, ("debug", "info", "warning", "error"), None, None, False, None),
    ("--step-delay-ms", "step_delay_ms", 0.0, "float", None, None, None, False, None),
    ("--snapshot-lease-wait-s", "snapshot_lease_wait_s", 10.0, "float", None, None, None, False, None),
    ("--snapshot-send-delay-ms", "snapshot_send_delay_ms", 0.0, "float", None, None, None, False, None),
    ("--tp-size", "tp_size", 1, "int", None, None, None, False, None),
    ("--shutdown-grace-s", "shutdown_grace_s", 30.0, "float", None, None, None, False, None),
    ("--fault-noop-updates", "fault_noop_updates", False, None, None, 0, True, False, None),
    ("--allow-pickled-tensors", "allow_pickled_tensors", False, None, None, 0, True, False, None),
    (
        "--weight-transfer-config",
        "weight_transfer_backend",
        "torch",
        "weight_transfer_config",
        None,
        None,
        None,
        False,
        "JSON",
    ),
    ("--enable-lora", "enable_lora", False, None, None, 0, True, False, None),
    ("--max-loras", "max_loras", 4, "int", None, None, None, False, None),
    ("--max-lora-rank", "max_lora_rank", 64, "int", None, None, None, False, None),
]


def flag_rows(parser: argparse.ArgumentParser) -> dict[str, Row]:
    rows = {}
    for a in parser._actions:  # argparse lists its actions nowhere public
        if isinstance(a, argparse._HelpAction):
            continue
        kind = None if a.type is None else getattr(a.type, "__name__", repr(a.type))
        choices = None if a.choices is None else tuple(a.choices)
        names = a.option_strings[0] if len(a.option_strings) == 1 else tuple(a.option_strings)
        rows[a.dest] = (names, a.dest, a.default, kind, choices, a.nargs, a.const, a.required, a.metavar)
    return rows


@pytest.mark.parametrize(
    ("parser", "expected"),
    [(router_cli.build_parser, ROUTER_FLAGS), (worker_cli.build_parser, WORKER_FLAGS)],
    ids=["omni-router", "omni-worker"],
)
def test_every_flag_is_declared_as_before(parser: Any, expected: list[Row]) -> None:
    built = parser()
    rows = flag_rows(built)
    assert rows == {row[1]: row for row in expected}
    hidden = {a.dest for a in built._actions if a.help == argparse.SUPPRESS}
    assert hidden == ({"data_plane_of", "data_plane_index"} if built.prog == "omni-router" else set())


# -- omni-router ------------------------------------------------------------------------------------------------

ROUTER_EVERY_FLAG = [
    *("--host", "0.0.0.0", "--port", "8080"),
    *("--worker-urls", "http://w0:30000", "http://w1:30000", "--worker-engine", "vllm"),
    *("--admin-api-key", "adm", "--worker-api-key", "wk", "--api-key", "gen", "--policy", "round_robin"),
    *("--session-affinity", "--session-affinity-ttl-s", "120", "--session-affinity-load-factor", "0.5"),
    *("--session-affinity-max-sessions", "500", "--version-policy", "max-staleness:2", "--sync-joiners", "off"),
    *("--verify-updates", "changed", "--min-routable-workers", "0.75", "--max-rejoin-attempts", "5"),
    *("--lora-keep-versions", "3"),
    *("--admin-lock-timeout-s", "60", "--request-timeout-s", "90.5", "--connect-timeout-s", "1.5"),
    *("--stream-stall-timeout-s", "7.5", "--body-budget-mb", "256"),
    *("--max-retries", "0", "--health-check-interval-s", "2", "--health-check-timeout-s", "1"),
    *("--health-failure-threshold", "4", "--health-dead-threshold", "9", "--health-success-threshold", "3"),
    *("--update-session-timeout-s", "45", "--shutdown-grace-s", "12", "--state-dir", "/var/lib/omni"),
    *("--max-connections", "64", "--service-discovery", "k8s", "--selector", "app=omni-worker", "tier=gpu="),
    *("--service-discovery-namespace", "ml", "--service-discovery-port", "31000"),
    *("--event-loop", "asyncio", "--data-plane-processes", "3", "--data-plane-ack-timeout-s", "7"),
    *("--state-store", "k8s", "--state-configmap-prefix", "rt-state", "--leader-election"),
    *("--leader-lease-name", "lease", "--leader-lease-duration-s", "20", "--leader-renew-deadline-s", "12"),
    *("--leader-retry-period-s", "3", "--leader-pod-label", "omni-router.io/role"),
    *(
        "--data-plane-of",
        "/tmp/control.sock",
        "--data-plane-index",
        "2",
        "--log-level",
        "debug",
        "--log-format",
        "json",
    ),
]

ROUTER_EVERY_SETTING = RouterConfig(
    worker_urls=["http://w0:30000", "http://w1:30000"],
    worker_engine="vllm",
    admin_api_key="adm",
    worker_api_key="wk",
    api_key="gen",
    policy="round_robin",
    session_affinity=True,
    session_affinity_ttl_s=120.0,
    session_affinity_load_factor=0.5,
    session_affinity_max_sessions=500,
    version_policy="max-staleness:2",
    verify_updates="changed",
    sync_joiners="off",
    min_routable_workers=0.75,
    max_rejoin_attempts=5,
    lora_keep_versions=3,
    admin_lock_timeout_s=60.0,
    request_timeout_s=90.5,
    stream_stall_timeout_s=7.5,
    body_budget_mb=256,
    connect_timeout_s=1.5,
    max_retries=0,
    health_check_interval_s=2.0,
    health_check_timeout_s=1.0,
    health_failure_threshold=4,
    health_dead_threshold=9,
    health_success_threshold=3,
    update_session_timeout_s=45.0,
    shutdown_grace_s=12.0,
    state_dir=Path("/var/lib/omni"),
    max_connections=64,
    service_discovery="k8s",
    selector={"app": "omni-worker", "tier": "gpu="},
    discovery_namespace="ml",
    discovery_port=31000,
    state_store="k8s",
    state_configmap_prefix="rt-state",
    leader_election=True,
    leader_lease_name="lease",
    leader_lease_duration_s=20.0,
    leader_renew_deadline_s=12.0,
    leader_retry_period_s=3.0,
    leader_pod_label="omni-router.io/role",
)

ROUTER_DEFAULTS = RouterConfig(
    worker_urls=[],
    worker_engine="auto",
    admin_api_key=None,
    worker_api_key=None,
    api_key=None,
    policy="least_inflight",
    session_affinity=False,
    session_affinity_ttl_s=600.0,
    session_affinity_load_factor=0.25,
    session_affinity_max_sessions=100_000,
    version_policy="latest-only",
    sync_joiners="peer",
    min_routable_workers=0,
    max_rejoin_attempts=None,
    admin_lock_timeout_s=300.0,
    request_timeout_s=1800.0,
    connect_timeout_s=5.0,
    max_retries=2,
    health_check_interval_s=10.0,
    health_check_timeout_s=5.0,
    health_failure_threshold=3,
    health_dead_threshold=None,
    health_success_threshold=2,
    update_session_timeout_s=None,
    shutdown_grace_s=30.0,
    state_dir=None,
    max_connections=1024,
    service_discovery="static",
    selector={},
    discovery_namespace=None,
    discovery_port=None,
    state_store=None,
    state_configmap_prefix="omni-router-state",
    leader_election=False,
    leader_lease_name="omni-router-leader",
    leader_lease_duration_s=15.0,
    leader_renew_deadline_s=10.0,
    leader_retry_period_s=2.0,
    leader_pod_label=None,
)


def parse_router(argv: list[str]) -> tuple[argparse.Namespace, ProcessSettings, RouterConfig]:
    args = router_cli.build_parser().parse_args(argv)
    return args, from_args(ProcessSettings, args), from_args(RouterConfig, args)


@pytest.fixture(autouse=True)
def no_admin_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def test_router_every_flag_sets_its_setting() -> None:
    args, process, config = parse_router(ROUTER_EVERY_FLAG)
    assert config == ROUTER_EVERY_SETTING
    assert process == ProcessSettings(
        host="0.0.0.0",
        port=8080,
        event_loop="asyncio",
        data_plane_processes="3",
        data_plane_ack_timeout_s=7.0,
        log_level="debug",
        log_format="json",
    )
    assert (args.data_plane_of, args.data_plane_index) == ("/tmp/control.sock", 2)


def test_router_defaults() -> None:
    args, process, config = parse_router([])
    assert config == ROUTER_DEFAULTS
    assert process == ProcessSettings(
        host="127.0.0.1",
        port=30000,
        event_loop="auto",
        data_plane_processes="auto",
        data_plane_ack_timeout_s=5.0,
        log_level="info",
        log_format="text",
    )
    assert (args.data_plane_of, args.data_plane_index) == (None, 0)


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        # An empty key (a manifest's unset variable) is no key; an empty namespace is passed on as it is.
        (["--admin-api-key", "", "--worker-api-key", "", "--api-key", ""], {}),
        (["--leader-pod-label", "", "--service-discovery-namespace", ""], {"discovery_namespace": ""}),
        (["--worker-urls"], {}),
        (["--worker-urls", "http://a:1", "--worker-urls", "http://b:2"], {"worker_urls": ["http://b:2"]}),
        (["--selector", "a=1", "--selector", "b=2"], {"selector": {"b": "2"}}),
        (["--selector", "a=1", "a=2"], {"selector": {"a": "2"}}),
        (
            ["--health-dead-threshold", "1", "--state-dir", "rel/dir"],
            {"health_dead_threshold": 1, "state_dir": Path("rel/dir")},
        ),
        (["--state-store", "dir", "--state-dir", "/s"], {"state_store": "dir", "state_dir": Path("/s")}),
        # A whole number is a count of workers (1 is one worker); below 1, a share of the fleet.
        (
            ["--min-routable-workers", "3", "--max-rejoin-attempts", "1"],
            {"min_routable_workers": 3, "max_rejoin_attempts": 1},
        ),
        (["--min-routable-workers", "3.0"], {"min_routable_workers": 3}),
        (["--min-routable-workers", "1"], {"min_routable_workers": 1}),
        (["--min-routable-workers", "0.5"], {"min_routable_workers": 0.5}),
    ],
)
def test_router_command_lines(argv: list[str], settings: dict[str, Any]) -> None:
    assert parse_router(argv)[2] == dataclasses.replace(ROUTER_DEFAULTS, **settings)


@pytest.mark.parametrize(
    ("env", "argv", "key"),
    [
        ("env-key", [], "env-key"),
        ("env-key", ["--admin-api-key", ""], "env-key"),
        ("env-key", ["--admin-api-key", "k"], "k"),
        ("", [], None),
    ],
)
def test_admin_key_falls_back_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str, argv: list[str], key: str | None
) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, env)
    assert parse_router(argv)[2].admin_api_key == key
    assert parse_worker(["--model-path", "m", *argv]).admin_api_key == key


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--selector", "novalue"], "argument --selector: expected KEY=VALUE, got 'novalue'"),
        (["--selector"], "argument --selector: expected at least one argument"),
        (["--policy", "fastest"], "argument --policy: invalid choice: 'fastest'"),
        (["--state-store", "memory"], "argument --state-store: invalid choice: 'memory'"),
        (["--port", "x"], "argument --port: invalid int value: 'x'"),
        (["--request-timeout-s", "soon"], "argument --request-timeout-s: invalid float value: 'soon'"),
        (
            ["--min-routable-workers", "2.5"],
            "argument --min-routable-workers: expected a whole number of workers (3) or a share of them below 1",
        ),
        (["--min-routable-workers", "-1"], "argument --min-routable-workers: expected a whole number"),
        (["--max-rejoin-attempts", "often"], "argument --max-rejoin-attempts: invalid int value: 'often'"),
    ],
)
def test_router_refuses_bad_words(capsys: pytest.CaptureFixture[str], argv: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        router_cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"omni-router: error: {error}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--shutdown-grace-s", "-1"], "cannot start: --shutdown-grace-s must be >= 0, got -1.0"),
        (["--leader-election"], "cannot start: --leader-election needs --state-store k8s"),
        (["--state-store", "dir"], "cannot start: --state-store dir needs --state-dir"),
        (["--service-discovery", "k8s"], "cannot start: --service-discovery k8s needs --selector k=v"),
        (["--version-policy", "newest"], "cannot start: "),
        (["--max-rejoin-attempts", "0"], "cannot start: --max-rejoin-attempts must be >= 1, got 0"),
        (["--lora-keep-versions", "0"], "cannot start: --lora-keep-versions must be >= 1, got 0"),
        (["--data-plane-processes", "many"], "cannot start: "),
    ],
)
def test_router_refuses_to_start_with_bad_settings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, argv: list[str], error: str
) -> None:
    monkeypatch.setattr(router_cli, "setup_logging", lambda level, fmt: None)  # keep this process's logging
    with caplog.at_level(logging.ERROR, logger="router"):
        assert router_cli.main(argv) == 2
    assert next(r.getMessage() for r in caplog.records if r.name == "router").startswith(error)


# -- omni-worker ------------------------------------------------------------------------------------------------

WORKER_EVERY_FLAG = [
    *("--model-path", "/models/llama", "--host", "0.0.0.0", "--port", "0", "--device", "cuda:1"),
    *("--dtype", "bfloat16", "--admin-api-key", "adm", "--api-key", "gen", "--max-running-requests", "4"),
    *("--num-threads", "1", "--served-model-name", "llama-rl", "--log-level", "warning", "--step-delay-ms", "250"),
    *("--snapshot-lease-wait-s", "2.5", "--snapshot-send-delay-ms", "5", "--tp-size", "2", "--shutdown-grace-s", "0"),
    *("--allow-pickled-tensors", "--weight-transfer-config", '{"backend": "nccl"}', "--fault-noop-updates"),
]

WORKER_EVERY_SETTING = WorkerConfig(
    model_path="/models/llama",
    host="0.0.0.0",
    port=0,
    device="cuda:1",
    dtype="bfloat16",
    admin_api_key="adm",
    api_key="gen",
    max_running_requests=4,
    log_level="warning",
    served_model_name="llama-rl",
    health_check_timeout_s=20.0,
    num_threads=1,
    tp_size=2,
    step_delay_s=0.25,
    shutdown_grace_s=0.0,
    fault_noop_updates=True,
    allow_pickled_tensors=True,
    snapshot_lease_wait_s=2.5,
    snapshot_send_delay_s=0.005,
    weight_transfer_backend="nccl",
)

WORKER_DEFAULTS = WorkerConfig(
    model_path="m",
    host="127.0.0.1",
    port=30000,
    device="cpu",
    dtype="float32",
    admin_api_key=None,
    api_key=None,
    max_running_requests=32,
    log_level="info",
    served_model_name=None,
    health_check_timeout_s=20.0,
    num_threads=None,
    tp_size=1,
    step_delay_s=0.0,
    shutdown_grace_s=30.0,
    allow_pickled_tensors=False,
    snapshot_lease_wait_s=10.0,
    snapshot_send_delay_s=0.0,
    weight_transfer_backend="torch",
)


def parse_worker(argv: list[str]) -> WorkerConfig:
    return from_args(WorkerConfig, worker_cli.build_parser().parse_args(argv))


def test_worker_every_flag_sets_its_setting() -> None:
    assert parse_worker(WORKER_EVERY_FLAG) == WORKER_EVERY_SETTING


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        ([], {}),
        (["--api-key", "", "--served-model-name", ""], {"served_model_name": ""}),
        (["--step-delay-ms", "1.5", "--snapshot-send-delay-ms", "0"], {"step_delay_s": 0.0015}),
        (["--weight-transfer-config", "nccl"], {"weight_transfer_backend": "nccl"}),
        (["--weight-transfer-config", '{"backend": "torch", "other": 1}'], {}),
        (["--device", "cuda", "--num-threads", "0"], {"device": "cuda", "num_threads": 0}),
    ],
)
def test_worker_command_lines(argv: list[str], settings: dict[str, Any]) -> None:
    assert parse_worker(["--model-path", "m", *argv]) == dataclasses.replace(WORKER_DEFAULTS, **settings)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([], "the following arguments are required: --model-path"),
        (["--model-path", "m", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (
            ["--model-path", "m", "--weight-transfer-config", '{"backend": "gloo"}'],
            'argument --weight-transfer-config: expected a JSON object with backend one of torch, nccl, got \'{"backend": "gloo"}\'',
        ),
        (["--model-path", "m", "--step-delay-ms", "slow"], "argument --step-delay-ms: invalid float value: 'slow'"),
    ],
)
def test_worker_refuses_bad_words(capsys: pytest.CaptureFixture[str], argv: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        worker_cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"omni-worker: error: {error}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
        (["--num-threads", "0"], "--num-threads must be at least 1"),
        (["--tp-size", "0"], "--tp-size must be at least 1"),
        (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be >= 0"),
        (["--device", "gpu"], "--device must be cpu, cuda or cuda:N, not 'gpu'"),
        (
            ["--weight-transfer-config", "nccl"],
            '--weight-transfer-config {"backend": "nccl"} needs a CUDA device (--device cuda)',
        ),
    ],
)
def test_worker_refuses_to_start_with_bad_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # keep this process's logging
    with pytest.raises(SystemExit) as exit_:
        worker_cli.main(["--model-path", "m", *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"omni-worker: error: {error}"


def test_worker_cuda_device_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda requested but no CUDA device is available"):
        WorkerConfig(model_path="m", device="cuda:0").validate()
    WorkerConfig(model_path="m").validate()


# -- the declarations ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Unreadable:
    when: Annotated[complex, Flag("a type the command line has no reading for")] = 0j


@dataclasses.dataclass
class _OnSwitch:
    on: Annotated[bool, Flag("a switch that is on already")] = True


@pytest.mark.parametrize(("cls", "error"), [(_Unreadable, "needs Flag\\(parse=...\\)"), (_OnSwitch, "off by default")])
def test_a_setting_the_command_line_cannot_express_is_refused(cls: type[Any], error: str) -> None:
    with pytest.raises(TypeError, match=error):
        add_flags(argparse.ArgumentParser(), cls)
