"""Side by side: omni-router against SGLang's Rust router (``sglang-router``) on one fixed-answer upstream.

    .venv/bin/python -m benchmarks.bench_peer_router                  # 5 interleaved rounds of 8 s, concurrency 16
    .venv/bin/python -m benchmarks.bench_peer_router --rounds 3 --seconds 5 --concurrency 16 64

Three targets get the same load from the same C load generator (``wrk``, one small Lua script
that POSTs a ``/generate`` body and prints its own latency percentiles), in interleaved rounds:

- ``upstream``: nginx on 127.0.0.1 answering ``POST /generate`` with a fixed SGLang-like body,
  and the routes both routers read from a worker at start-up and in their health checks
  (``/health``, ``/model_info``, ``/get_model_info``, ``/server_info``). It is the ceiling and is
  never the bottleneck (nginx answers from memory);
- ``rust``: ``sglang-router`` (installed from PyPI into a side virtualenv) in front of it;
- ``omni``: this repository's ``omni-router`` in front of it.

Printed: req/s, p50 and p99 per target and round, the medians over rounds, and omni ÷ rust for
throughput and p50. Every process started here listens on 127.0.0.1 and is stopped at the end;
every load run stops by itself after ``--seconds``.

Needs ``nginx`` and ``wrk`` (Debian: ``apt-get install nginx-light wrk``; installed here when
missing and this runs as root with apt) and ``sglang-router`` (``pip install sglang-router==0.3.2``
into ``--sglang-venv``, done here when that venv has no ``sglang-router``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from demo.launch import ManagedProcess, cli, free_port, http_json

SGLANG_ROUTER_VERSION = "0.3.2"
DEFAULT_SGLANG_VENV = Path(tempfile.gettempdir()) / f"omni-bench-sglang-router-{SGLANG_ROUTER_VERSION}"

#: One prompt as a trainer sends it (no rid: the routers assign one where they need it).
REQUEST_BODY = json.dumps(
    {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
)

#: What the upstream answers, SGLang's shape (one prompt).
GENERATE_REPLY = json.dumps(
    {
        "text": " Paris. It is also the largest city",
        "output_ids": [12366, 13, 1084, 374, 1083, 279, 7772, 3283],
        "meta_info": {
            "id": "bench",
            "finish_reason": {"type": "length", "length": 8},
            "prompt_tokens": 5,
            "completion_tokens": 8,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.001,
        },
    }
)

#: Read-only worker routes, answered so that both routers take the upstream as a healthy SGLang server.
WORKER_INFO = {
    "/health": {"status": "ok", "weight_version": "default"},
    "/model_info": {
        "model_path": "bench/fixed-answer",
        "tokenizer_path": None,
        "is_generation": True,
        "weight_version": "default",
        "tp_size": 1,
    },
    "/server_info": {"tp_size": 1, "dp_size": 1, "weight_version": "default", "version": "bench"},
}
WORKER_INFO["/get_model_info"] = WORKER_INFO["/model_info"]
WORKER_INFO["/get_server_info"] = WORKER_INFO["/server_info"]

LUA_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BENCH_BODY")

done = function(summary, latency, requests)
  io.write(string.format(
    "BENCH_RESULT {\\"requests\\": %d, \\"duration_us\\": %d, \\"p50_us\\": %d, \\"p99_us\\": %d, " ..
    "\\"non2xx\\": %d, \\"socket_errors\\": %d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.status, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


class SetupError(RuntimeError):
    """A tool the benchmark needs is missing and could not be installed here."""


# ----------------------------------------------------------------------------- tools


def _apt_install(packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        raise SetupError(f"apt-get not found: install {' '.join(packages)} with this system's package manager")
    if os.geteuid() != 0:
        raise SetupError(f"not root: run `sudo apt-get install -y {' '.join(packages)}` first")
    print(f"# installing {' '.join(packages)} with apt-get", flush=True)
    update = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
    if update.returncode != 0:
        raise SetupError(f"apt-get update failed (is the Debian mirror reachable?):\n{update.stderr[-2000:]}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-qq", *packages], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SetupError(f"apt-get install {' '.join(packages)} failed:\n{done.stderr[-2000:]}")


def ensure_system_tools() -> tuple[str, str]:
    """Paths of nginx and wrk, installed with apt when missing (nginx-light, else nginx)."""
    missing = [name for name in ("nginx", "wrk") if _which(name) is None]
    if missing:
        wanted = ["wrk"] if "wrk" in missing else []
        if "nginx" in missing:
            try:
                _apt_install([*wanted, "nginx-light"])
                wanted = []
            except SetupError:
                wanted.append("nginx")  # newer Debian releases ship only "nginx"
        if wanted:
            _apt_install(wanted)
    nginx, wrk = _which("nginx"), _which("wrk")
    if nginx is None or wrk is None:
        raise SetupError("nginx and wrk are still missing after apt-get install")
    return nginx, wrk


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/local/sbin") / name) if p.exists()), None
    )


def ensure_sglang_router(venv: Path) -> Path:
    """The Python of a virtualenv holding ``sglang-router``; created and installed from PyPI when missing."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import sglang_router"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"# installing sglang-router=={SGLANG_ROUTER_VERSION} into {venv}", flush=True)
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        raise SetupError(
            f"could not create a virtualenv at {venv} (Debian: apt-get install python3-venv):\n{made.stderr}"
        )
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        raise SetupError(
            f"pip install sglang-router=={SGLANG_ROUTER_VERSION} failed (is PyPI reachable?); "
            f"install it by hand into {venv}, or pass --sglang-venv:\n{pip.stderr[-2000:]}"
        )
    return python


# ----------------------------------------------------------------------------- the three targets


def _nginx_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_config(root: Path, port: int) -> str:
    locations = "\n".join(
        f"    location = {path} {{ return 200 {_nginx_string(json.dumps(body))}; }}"
        for path, body in WORKER_INFO.items()
    )
    temp = " ".join(f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temp}
  keepalive_requests 100000000;
  keepalive_timeout 120s;
  default_type application/json;
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location = /generate {{ return 200 {_nginx_string(GENERATE_REPLY)}; }}
{locations}
    location / {{ return 404 '{{"error": {{"message": "not served by the benchmark upstream"}}}}'; }}
  }}
}}
"""


@dataclass
class Target:
    name: str
    url: str
    proc: ManagedProcess | None = None


def _wait_generate(url: str, proc: ManagedProcess, timeout: float = 60.0) -> None:
    """Until ``POST /generate`` answers 200 through this target (its worker is registered and healthy)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited before it served /generate:\n{proc.log_text()}")
        try:
            status, body = http_json("POST", url + "/generate", json.loads(REQUEST_BODY), timeout=2.0)
            if status == 200:
                return
            last = f"{status} {body}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name}: /generate not served within {timeout}s (last: {last}):\n{proc.log_text()}")


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


@contextlib.contextmanager
def targets(args: argparse.Namespace, nginx: str, sglang_python: Path) -> Iterator[list[Target]]:
    started: list[ManagedProcess] = []
    with tempfile.TemporaryDirectory(prefix="omni-bench-peer-") as tmp:
        root = Path(tmp)
        try:
            up_port = free_port()
            (root / "nginx.conf").write_text(nginx_config(root, up_port))
            upstream = ManagedProcess("bench-nginx", [nginx, "-c", str(root / "nginx.conf"), "-p", str(root)]).start()
            started.append(upstream)
            up = Target("upstream", f"http://127.0.0.1:{up_port}", upstream)
            _wait_generate(up.url, upstream)

            rust_port, metrics_port = free_port(), free_port()
            rust = ManagedProcess(
                "bench-sglang-router",
                [
                    str(sglang_python),
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rust_port),
                    "--worker-urls",
                    up.url,
                    "--policy",
                    args.rust_policy,
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(metrics_port),
                    "--log-level",
                    "warn",
                ],
            ).start()
            started.append(rust)
            rs = Target("rust", f"http://127.0.0.1:{rust_port}", rust)

            omni_port = free_port()
            omni = ManagedProcess(
                "bench-omni-router", [cli("omni-router"), *omni_argv(args, up.url, omni_port, root / "omni-state")]
            ).start()
            started.append(omni)
            om = Target("omni", f"http://127.0.0.1:{omni_port}", omni)
            found = [up, rs, om]
            if args.omni_baseline is not None:
                # Another checkout's router (e.g. the commit before a change), run from its own source tree.
                base_port = free_port()
                launcher = f"import sys; sys.path.insert(0, {str(args.omni_baseline)!r}); from router.gateway.cli import main; sys.exit(main())"
                base = ManagedProcess(
                    "bench-omni-baseline",
                    [sys.executable, "-c", launcher, *omni_argv(args, up.url, base_port, root / "baseline-state")],
                ).start()
                started.append(base)
                found.append(Target("omni-base", f"http://127.0.0.1:{base_port}", base))
            for t in found[1:]:
                assert t.proc is not None
                _wait_generate(t.url, t.proc)
            yield found
        finally:
            for proc in reversed(started):
                proc.stop()


# ----------------------------------------------------------------------------- load


@dataclass
class Sample:
    rps: float
    p50_ms: float
    p99_ms: float


def run_wrk(wrk: str, lua: Path, url: str, *, seconds: float, concurrency: int, threads: int) -> Sample:
    argv = [
        wrk,
        f"-t{min(threads, concurrency)}",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(lua),
        url + "/generate",
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + 60, env={**os.environ, "BENCH_BODY": REQUEST_BODY}
    )
    match = re.search(r"^BENCH_RESULT (\{.*\})$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"wrk against {url} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    r = json.loads(match.group(1))
    if r["non2xx"] or r["socket_errors"] or not r["requests"]:
        raise RuntimeError(f"{url}: {r['non2xx']} non-2xx answers, {r['socket_errors']} socket errors: {r}")
    return Sample(r["requests"] / (r["duration_us"] / 1e6), r["p50_us"] / 1000.0, r["p99_us"] / 1000.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each target once per round)")
    p.add_argument("--seconds", type=float, default=8.0, help="duration of one load run (whole seconds)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16], help="open connections of the load generator")
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--warmup-s", type=float, default=2.0, help="an unmeasured load run per target first")
    p.add_argument("--sglang-venv", type=Path, default=DEFAULT_SGLANG_VENV, help="virtualenv holding sglang-router")
    p.add_argument("--rust-policy", default="round_robin", help="sglang-router --policy")
    p.add_argument(
        "--omni-baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also measure the omni-router of another source tree (e.g. `git archive <commit> router | tar -x -C DIR`)",
    )
    p.add_argument("--omni-args", nargs=argparse.REMAINDER, default=[], help="extra omni-router flags (must come last)")
    args = p.parse_args()
    try:
        nginx, wrk = ensure_system_tools()
        sglang_python = ensure_sglang_router(args.sglang_venv)
    except SetupError as exc:
        print(f"cannot run the benchmark: {exc}", file=sys.stderr)
        return 2
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
    print(
        f"# cpus: {os.cpu_count()}; python {sys.version.split()[0]}; {version}; sglang-router {SGLANG_ROUTER_VERSION}; "
        f"wrk -t{args.threads}; {args.rounds} rounds x {args.seconds:g}s"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA_SCRIPT)
        lua = Path(f.name)
    try:
        with targets(args, nginx, sglang_python) as tgts:
            for conc in args.concurrency:
                samples: dict[str, list[Sample]] = {t.name: [] for t in tgts}
                for t in tgts:
                    run_wrk(wrk, lua, t.url, seconds=args.warmup_s, concurrency=conc, threads=args.threads)
                print(f"\n## concurrency {conc}")
                print(f"{'round':>5} {'target':<9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
                for rnd in range(1, args.rounds + 1):
                    # Rotate the order so no target always runs right after the same one.
                    order = tgts[rnd % len(tgts) :] + tgts[: rnd % len(tgts)]
                    for t in order:
                        s = run_wrk(wrk, lua, t.url, seconds=args.seconds, concurrency=conc, threads=args.threads)
                        samples[t.name].append(s)
                        print(f"{rnd:>5} {t.name:<9} {s.rps:>9.0f} {s.p50_ms:>8.3f} {s.p99_ms:>8.3f}", flush=True)
                med = {
                    name: Sample(*(statistics.median(getattr(s, f) for s in xs) for f in ("rps", "p50_ms", "p99_ms")))
                    for name, xs in samples.items()
                }
                print(f"\nmedians over {args.rounds} rounds, concurrency {conc}:")
                for name, s in med.items():
                    print(f"  {name:<9} {s.rps:>9.0f} req/s   p50 {s.p50_ms:.3f} ms   p99 {s.p99_ms:.3f} ms")
                rs = med["rust"]
                for name in [n for n in med if n.startswith("omni")]:
                    om = med[name]
                    print(
                        f"  {name} ÷ rust: throughput {om.rps / rs.rps:.2f}x   p50 {om.p50_ms / rs.p50_ms:.2f}x   "
                        f"p99 {om.p99_ms / rs.p99_ms:.2f}x"
                    )
    finally:
        lua.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
