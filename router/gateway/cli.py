"""``omni-router``: parse flags, build the app, serve until stopped.

``omni-router status [...]`` instead reads a running router's fleet (:mod:`router.gateway.status`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from router import __version__
from router.contract.errors import ApiError
from router.contract.settings import Flag, add_flags, from_args
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from router.gateway.frontend.site import lean_tcp
from router.gateway.k8s_extra import require_client
from router.gateway.processes.control import DEFAULT_ACK_TIMEOUT_S
from router.gateway.processes.launch import data_plane_count, run_control, run_data_plane
from router.gateway.serving import Hooks, serve, tcp

log = logging.getLogger("router")

EventLoopName = Literal["auto", "uvloop", "asyncio"]
LogLevel = Literal["debug", "info", "warning", "error"]


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


@dataclass(kw_only=True, frozen=True)
class ProcessSettings:
    """How this process serves the app: its address, event loop, data-plane processes and logs
    (the app's own settings are :class:`RouterConfig`'s)."""

    host: Annotated[str, Flag("address to listen on")] = "127.0.0.1"
    port: Annotated[int, Flag("TCP port to listen on")] = 30000
    event_loop: Annotated[EventLoopName, Flag("auto: uvloop when it is installed, else asyncio's loop")] = "auto"
    data_plane_processes: Annotated[
        str,
        Flag(
            "processes serving the generation routes on --port (SO_REUSEPORT) beside one control process that owns "
            "the registry, health, admin lock and fences; auto: one per usable core (at most 8); 1: one process",
            metavar="N|auto",
        ),
    ] = "auto"
    generation_server: Annotated[
        Literal["lean", "aiohttp"],
        Flag(
            "what serves the generation routes on --port (in each data-plane process, or the one process): lean (the "
            "router's own HTTP/1.1 server: llhttp, one write per answer; other routes' connections go to aiohttp) or "
            "aiohttp's server for every route"
        ),
    ] = "lean"
    data_plane_ack_timeout_s: Annotated[
        float,
        Flag(
            "how long a fenced admin call waits for every data-plane process to apply the fence before it fails "
            "closed (503, nothing sent) and the late process is restarted"
        ),
    ] = DEFAULT_ACK_TIMEOUT_S
    log_level: Annotated[LogLevel, Flag("log verbosity")] = "info"
    log_format: Annotated[Literal["text", "json"], Flag("log line format")] = "text"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-router",
        description="One URL in front of N inference workers (omni-worker, vLLM, SGLang): routing, admin broadcast, "
        "weight sync.",
        epilog="omni-router status [--url URL] [--watch [SECONDS]] [--json] shows a running router's fleet "
        "(omni-router status --help).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_flags(p, ProcessSettings)
    add_flags(p, RouterConfig)
    # Set by the control process when it starts a data plane: not for operators.
    p.add_argument("--data-plane-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-plane-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _kubernetes_flag(config: RouterConfig) -> str | None:
    """The first flag set that needs the k8s extra's client before the app is built, if any."""
    if config.leader_election:
        return "--leader-election"
    if config.state_store == "k8s":
        return "--state-store k8s"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":  # a client of a running router, with flags of its own
        from router.gateway.status import main as status

        return status(argv[1:], default_port=ProcessSettings().port)
    args = build_parser().parse_args(argv)
    process = from_args(ProcessSettings, args)
    setup_logging(process.log_level, process.log_format)
    config = from_args(RouterConfig, args)
    try:
        config.validate()
        loop_factory = event_loop_factory(process.event_loop)
        processes = data_plane_count(process.data_plane_processes)
    except (RuntimeError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    host, port = process.host, process.port
    config.generation_processes = processes  # they share the body budget
    if args.data_plane_of is not None:  # started by a control process: serve its generation routes
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(
                run_data_plane(
                    config,
                    socket_path=args.data_plane_of,
                    index=args.data_plane_index,
                    host=host,
                    port=port,
                    lean=process.generation_server == "lean",
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
    if processes > 1 and port == 0:
        if process.data_plane_processes == "auto":  # an OS-chosen port cannot be shared: one process
            processes = config.generation_processes = 1
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
                    host=host,
                    port=port,
                    ack_timeout_s=process.data_plane_ack_timeout_s,
                )
            )
        else:
            listen = (lean_tcp if process.generation_server == "lean" else tcp)(host, port)
            runner.run(serve(app, listen, config.shutdown_grace_s, Hooks(on_started=_ready(config))))
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
