"""What the peer benchmarks need from the machine: ``nginx`` and ``wrk`` (installed with apt when missing
and run as root), SGLang's Rust routers (``sglang-router``, ``smg``) each in its own side virtualenv from
PyPI, how each is started, and one line that names the machine a run was measured on."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SGLANG_ROUTER_VERSION = "0.3.2"
SMG_VERSION = "1.13.0"
DEFAULT_SGLANG_VENV = Path(tempfile.gettempdir()) / f"omni-bench-sglang-router-{SGLANG_ROUTER_VERSION}"
DEFAULT_SMG_VENV = Path(tempfile.gettempdir()) / f"omni-bench-smg-{SMG_VERSION}"


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


@dataclass(frozen=True)
class Peer:
    """A Rust router from PyPI, run from its own virtualenv."""

    name: str  # also the PyPI distribution
    version: str  # what gets installed into a venv that has none
    module: str  # imported to check the venv
    venv_flag: str


PEERS = {
    "sglang-router": Peer("sglang-router", SGLANG_ROUTER_VERSION, "sglang_router", "--sglang-venv"),
    "smg": Peer("smg", SMG_VERSION, "smg", "--smg-venv"),
}


def _installed_version(python: Path, peer: Peer) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m, {peer.module}; print(m.version({peer.name!r}))"
    probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 and probe.stdout.strip() else None


def ensure_peer(peer: Peer, venv: Path) -> str:
    """The version of ``peer`` in ``venv``; the venv is created and the pinned version installed from PyPI when missing."""
    python = venv / "bin" / "python"
    found = _installed_version(python, peer)
    if found is not None:
        return found
    print(f"# installing {peer.name}=={peer.version} into {venv}", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        raise SetupError(
            f"could not create a virtualenv at {venv} (Debian: apt-get install python3-venv):\n{made.stderr}"
        )
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{peer.name}=={peer.version}"], capture_output=True, text=True
    )
    found = _installed_version(python, peer)
    if pip.returncode != 0 or found is None:
        raise SetupError(
            f"pip install {peer.name}=={peer.version} failed (is PyPI reachable?); "
            f"install it by hand into {venv}, or pass {peer.venv_flag}:\n{pip.stderr[-2000:]}"
        )
    return found


def peer_argv(peer: Peer, venv: Path, *, upstream: str, port: int, metrics_port: int, policy: str) -> list[str]:
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        upstream,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]
    if peer.name == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
    # smg would otherwise try to load a tokenizer for the model the upstream names (bench/fixed-answer),
    # from the Hugging Face hub; /generate with text needs none.
    return [str(venv / "bin" / "smg"), "launch", *common, "--disable-tokenizer-autoload"]


def machine_line() -> str:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                model = value.strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"# machine: {usable} usable cores (os.sched_getaffinity; os.cpu_count {os.cpu_count()}); {model}; "
        f"{platform.system()} {platform.machine()}; load average at start {load}"
    )


# ----------------------------------------------------------------------------- the targets
