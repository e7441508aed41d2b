"""Side by side: omni-router against two Rust routers from the SGLang project on one fixed-answer upstream.

    .venv/bin/python -m benchmarks.bench_peer_router                  # 5 interleaved rounds of 8 s, concurrency 16
    .venv/bin/python -m benchmarks.bench_peer_router --rounds 3 --seconds 5 --concurrency 16 64
    .venv/bin/python -m benchmarks.bench_peer_router --peers smg --omni-processes 1 2 auto

Every target gets the same load from the same C load generator (``wrk``, one small Lua script that
POSTs a ``/generate`` body without ``rid`` and prints its own latency percentiles):

- ``nginx upstream, direct``: nginx on 127.0.0.1 answering ``POST /generate`` with a fixed
  SGLang-shaped body, and the routes the routers read from a worker at start-up and in their
  health checks (``/health``, ``/model_info``, ``/get_model_info``, ``/server_info``,
  ``/get_server_info``). It is the ceiling and never the bottleneck (nginx answers from memory).
  smg also asks for ``/v1/models``, ``/version``, ``/loads``, ``/v1/loads`` and (every 10 s, its
  load monitor) ``/metrics``; it takes their 404 in its stride, so they are not served;
- the Rust peers in front of it (``--peers``, both by default), each installed from PyPI into its
  own side virtualenv and started with ``--policy round_robin --log-level warn`` and its metrics
  listener on 127.0.0.1:
  ``sglang-router`` 0.3.2 (``python -m sglang_router.launch_router``), and the SGLang Model Gateway
  ``smg`` 1.13.0 (``smg launch``, also ``--disable-tokenizer-autoload``: this benchmark sends no
  chat or OpenAI request, and no tokenizer is ever fetched from the network);
- this repository's ``omni-router`` in front of it, once per ``--omni-processes`` value (``1`` and
  ``auto`` by default), run with ``--data-plane-processes`` set to that value: ``auto`` is the
  router's default (one data-plane process per usable core, at most 8, sharing the port with
  SO_REUSEPORT beside one control process), ``1`` the single process. A target counts as started
  once ``POST /generate`` answers 200 through it and all its data planes listen on the port.

Each concurrency level runs one unmeasured warm-up per target, then ``--rounds`` rounds, each
running every target once (the order rotates from round to round so no target always follows the
same one). Printed: the machine (usable cores from ``os.sched_getaffinity``, the CPU model from
``/proc/cpuinfo``, the load average at start), the versions, req/s, p50 and p99 per target and
round, then per concurrency the medians over the rounds as a Markdown table and the ratios the
project's target is stated in: every omni-router target ÷ the faster Rust peer (the one with the
higher median req/s) for throughput, p50 and p99; the row of the default process count (``auto``)
is marked. Every process started here listens on 127.0.0.1 and is stopped at the end; every load
run stops by itself after ``--seconds``.

Installs what is missing: ``nginx`` and ``wrk`` with apt (Debian: ``apt-get install nginx-light
wrk``, when this runs as root), ``sglang-router==0.3.2`` into ``--sglang-venv`` and ``smg==1.13.0``
into ``--smg-venv`` with pip from PyPI (each venv is created when it does not hold its package; a
venv passed in that holds another version is used as it is, and the version is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.load_tools import LUA_SCRIPT, REQUEST_BODY, Sample, nginx_config, run_wrk
from benchmarks.peer_tools import (
    DEFAULT_SGLANG_VENV,
    DEFAULT_SMG_VENV,
    PEERS,
    SetupError,
    ensure_peer,
    ensure_system_tools,
    machine_line,
    peer_argv,
)
from demo.launch import ManagedProcess, cli, free_port, http_json
from router.gateway.processes.launch import data_plane_count


@dataclass
class Target:
    name: str
    url: str
    port: int
    proc: ManagedProcess
    kind: str  # "upstream", "peer" or "omni"
    listeners: int = 1  # sockets listening on the port once every process is up
    default: bool = False  # omni-router at its default process count


def _listening_sockets(port: int) -> int | None:
    """How many sockets listen on 127.0.0.1:``port`` (several with SO_REUSEPORT); None where /proc cannot tell."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    count = 0
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
            count += 1
    return count


def _wait_ready(t: Target, timeout: float = 60.0) -> None:
    """Until every process of ``t`` listens and ``POST /generate`` answers 200 through it, on fresh connections."""
    deadline = time.monotonic() + timeout
    last, streak = "", 0
    while time.monotonic() < deadline:
        if not t.proc.alive:
            raise RuntimeError(f"{t.proc.name} exited before it served /generate:\n{t.proc.log_text()}")
        listening = _listening_sockets(t.port)
        try:
            status, body = http_json("POST", t.url + "/generate", json.loads(REQUEST_BODY), timeout=2.0)
            last = f"{status} {body}"
        except OSError as exc:
            status, last = 0, repr(exc)
        streak = streak + 1 if status == 200 else 0
        # Each call opens a new connection, which SO_REUSEPORT hands to one of the listening processes.
        if streak >= 4 * t.listeners and (listening is None or listening >= t.listeners):
            return
        if status != 200:
            time.sleep(0.2)
    raise TimeoutError(
        f"{t.proc.name}: /generate not served by {t.listeners} listener(s) within {timeout}s "
        f"(listening: {_listening_sockets(t.port)}; last: {last}):\n{t.proc.log_text()}"
    )


def omni_argv(args: argparse.Namespace, upstream: str, port: int, state_dir: Path) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        upstream,
        "--log-level",
        "warning",
        "--state-dir",
        str(state_dir),
        *args.omni_args,
    ]


def omni_name(value: str, count: int) -> str:
    shape = "1 process" if count == 1 else f"{count} data planes"
    return f"omni-router (auto = {shape})" if value == "auto" else f"omni-router ({shape})"


@contextlib.contextmanager
def targets(args: argparse.Namespace, nginx: str, peers: dict[str, tuple[Path, str]]) -> Iterator[list[Target]]:
    started: list[ManagedProcess] = []
    with tempfile.TemporaryDirectory(prefix="omni-bench-peer-") as tmp:
        root = Path(tmp)

        def start(
            name: str, argv: list[str], port: int, kind: str, listeners: int = 1, default: bool = False
        ) -> Target:
            proc = ManagedProcess("bench-" + re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-"), argv).start()
            started.append(proc)
            return Target(name, f"http://127.0.0.1:{port}", port, proc, kind, listeners, default)

        try:
            up_port = free_port()
            (root / "nginx.conf").write_text(nginx_config(root, up_port))
            up = start(
                "nginx upstream, direct", [nginx, "-c", str(root / "nginx.conf"), "-p", str(root)], up_port, "upstream"
            )
            _wait_ready(up)
            found = [up]
            for key, (venv, version) in peers.items():
                port = free_port()
                argv = peer_argv(
                    PEERS[key], venv, upstream=up.url, port=port, metrics_port=free_port(), policy=args.rust_policy
                )
                found.append(start(f"{key} {version}", argv, port, "peer"))
            for i, value in enumerate(args.omni_processes):
                count, port = data_plane_count(value), free_port()
                argv = [
                    cli("omni-router"),
                    *omni_argv(args, up.url, port, root / f"omni-state-{i}"),
                    "--data-plane-processes",
                    value,
                ]
                found.append(
                    start(omni_name(value, count), argv, port, "omni", listeners=count, default=value == "auto")
                )
            for i, variant in enumerate(args.omni_variant):
                # The same router with more flags (a feature's cost), at the first --omni-processes value.
                value = args.omni_processes[0]
                count, port = data_plane_count(value), free_port()
                argv = [
                    cli("omni-router"),
                    *omni_argv(args, up.url, port, root / f"omni-variant-state-{i}"),
                    "--data-plane-processes",
                    value,
                    *shlex.split(variant),
                ]
                found.append(start(f"{omni_name(value, count)} {variant}", argv, port, "omni", listeners=count))
            if args.omni_baseline is not None:
                # Another checkout's router (e.g. the commit before a change), run from its own source tree
                # at its own default process count (listeners: at least one).
                port = free_port()
                # Its data planes run `python -m router.gateway.cli` from its working directory: that tree's too.
                tree = str(args.omni_baseline.resolve())
                launcher = (
                    f"import os, sys; os.chdir({tree!r}); sys.path.insert(0, {tree!r}); "
                    "from router.gateway.cli import main; sys.exit(main())"
                )
                argv = [sys.executable, "-c", launcher, *omni_argv(args, up.url, port, root / "baseline-state")]
                found.append(start("omni-router baseline", argv, port, "omni"))
            for t in found[1:]:
                _wait_ready(t)
            yield found
        finally:
            for proc in reversed(started):
                proc.stop()


# ----------------------------------------------------------------------------- load


def print_summary(tgts: list[Target], med: dict[str, Sample], *, rounds: int, conc: int) -> None:
    print(f"\nmedians over {rounds} rounds, concurrency {conc}:\n")
    print(f"| concurrency {conc} | req/s | p50 | p99 |")
    print("|---|---|---|---|")
    for t in tgts:
        s = med[t.name]
        print(f"| {t.name} | {s.rps:,.0f} | {s.p50_ms:.3f} ms | {s.p99_ms:.2f} ms |")
    peers = [t for t in tgts if t.kind == "peer"]
    if not peers:
        return
    fast = max(peers, key=lambda t: med[t.name].rps)
    rs = med[fast.name]
    print(f"\nomni-router ÷ the faster Rust peer ({fast.name}, {rs.rps:,.0f} req/s), concurrency {conc}:\n")
    print("| ratio | throughput | p50 | p99 |")
    print("|---|---|---|---|")
    for t in tgts:
        if t.kind != "omni":
            continue
        om = med[t.name]
        label = f"**{t.name} ÷ {fast.name}** (default)" if t.default else f"{t.name} ÷ {fast.name}"
        print(
            f"| {label} | {om.rps / rs.rps:.2f}× | {om.p50_ms / rs.p50_ms:.2f}× | {om.p99_ms / rs.p99_ms:.2f}× |",
            flush=True,
        )


def _process_count(value: str) -> str:
    if value != "auto":
        try:
            data_plane_count(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a positive number or auto, got {value!r}") from exc
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each target once per round)")
    p.add_argument("--seconds", type=float, default=8.0, help="duration of one load run (whole seconds)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16], help="open connections of the load generator")
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--warmup-s", type=float, default=2.0, help="an unmeasured load run per target first")
    p.add_argument(
        "--peers",
        nargs="*",
        choices=list(PEERS),
        default=list(PEERS),
        help="Rust routers to measure beside omni-router (default: both; none: omni-router and the upstream only)",
    )
    p.add_argument("--sglang-venv", type=Path, default=DEFAULT_SGLANG_VENV, help="virtualenv holding sglang-router")
    p.add_argument("--smg-venv", type=Path, default=DEFAULT_SMG_VENV, help="virtualenv holding smg")
    p.add_argument("--rust-policy", default="round_robin", help="--policy of the Rust routers")
    p.add_argument(
        "--omni-processes",
        nargs="+",
        type=_process_count,
        default=["1", "auto"],
        metavar="N|auto",
        help="omni-router --data-plane-processes values, one target each (default: 1 auto)",
    )
    p.add_argument(
        "--omni-baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also measure the omni-router of another source tree (e.g. `git archive <commit> router | tar -x -C DIR`)",
    )
    p.add_argument(
        "--omni-variant",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also measure omni-router with these extra flags (one quoted string, repeatable), e.g. "
        "'--session-affinity --version-policy max-staleness:1'",
    )
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header on every request, to every target (repeatable), e.g. 'X-Version-Policy: any'",
    )
    p.add_argument(
        "--session-keys",
        type=int,
        default=0,
        metavar="N",
        help="send X-Session-Id: session-<1..N>, drawn at random per request, to every target (0: none)",
    )
    p.add_argument("--omni-args", nargs=argparse.REMAINDER, default=[], help="extra omni-router flags (must come last)")
    args = p.parse_args()
    args.peers = list(dict.fromkeys(args.peers))
    args.omni_processes = list(dict.fromkeys(args.omni_processes))
    print(machine_line(), flush=True)
    try:
        nginx, wrk = ensure_system_tools()
        venvs = {"sglang-router": args.sglang_venv, "smg": args.smg_venv}
        peers = {key: (venvs[key], ensure_peer(PEERS[key], venvs[key])) for key in args.peers}
    except SetupError as exc:
        print(f"cannot run the benchmark: {exc}", file=sys.stderr)
        return 2
    nginx_version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
    wrk_version = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split(" [")[0].strip()
    peer_versions = "".join(f"; {key} {version}" for key, (_, version) in peers.items())
    print(
        f"# python {sys.version.split()[0]}; {nginx_version}; {wrk_version}{peer_versions}; "
        f"wrk -t{args.threads}; {args.rounds} rounds x {args.seconds:g}s"
    )
    load: dict[str, Any] = {"headers": args.header, "session_keys": args.session_keys}
    if args.header or args.session_keys:
        print(f"# every request: headers {args.header}, session keys {args.session_keys}")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA_SCRIPT)
        lua = Path(f.name)
    try:
        with targets(args, nginx, peers) as tgts:
            width = max(len(t.name) for t in tgts)
            for conc in args.concurrency:
                samples: dict[str, list[Sample]] = {t.name: [] for t in tgts}
                for t in tgts:
                    run_wrk(wrk, lua, t.url, seconds=args.warmup_s, concurrency=conc, threads=args.threads, **load)
                print(f"\n## concurrency {conc}")
                print(f"{'round':>5} {'target':<{width}} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
                for rnd in range(1, args.rounds + 1):
                    # Rotate the order so no target always runs right after the same one.
                    order = tgts[rnd % len(tgts) :] + tgts[: rnd % len(tgts)]
                    for t in order:
                        s = run_wrk(
                            wrk, lua, t.url, seconds=args.seconds, concurrency=conc, threads=args.threads, **load
                        )
                        samples[t.name].append(s)
                        print(f"{rnd:>5} {t.name:<{width}} {s.rps:>9.0f} {s.p50_ms:>8.3f} {s.p99_ms:>8.3f}", flush=True)
                med = {
                    name: Sample(*(statistics.median(getattr(s, f) for s in xs) for f in ("rps", "p50_ms", "p99_ms")))
                    for name, xs in samples.items()
                }
                print_summary(tgts, med, rounds=args.rounds, conc=conc)
    finally:
        lua.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
