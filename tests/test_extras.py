"""The console scripts without their optional extras: one line naming the extra, exit 2, no traceback.

Each case runs the entry point pyproject.toml declares, in a fresh interpreter whose import of the
extra's modules fails: a ``sys.meta_path`` finder placed first raises ``ModuleNotFoundError`` for them,
exactly what Python raises where a package is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from router import __version__
from router.gateway.k8s_extra import require_client

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

#: Run as ``python -c``: block some top-level modules, then call a console script's entry point as its
#: installed wrapper does (``sys.argv[0]`` the script's name), and report which project modules it loaded.
RUNNER = """
import importlib, sys

BLOCKED = {blocked!r}

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
sys.argv = [{script!r}, *{argv!r}]
module, _, function = {entry!r}.partition(":")
try:
    code = getattr(importlib.import_module(module), function)()
finally:
    print("loaded:", " ".join(sorted(m for m in sys.modules if m.startswith(("worker.", "torch", "lightkube")))))
sys.exit(code)
"""


def run_script(script: str, argv: list[str], blocked: set[str]) -> subprocess.CompletedProcess[str]:
    code = RUNNER.format(blocked=sorted(blocked), script=script, argv=argv, entry=SCRIPTS[script])
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def loaded(done: subprocess.CompletedProcess[str]) -> set[str]:
    line = next(line for line in done.stdout.splitlines() if line.startswith("loaded:"))
    return set(line.removeprefix("loaded:").split())


@pytest.mark.parametrize(
    "blocked",
    [{"torch", "safetensors", "tokenizers", "jinja2"}, {"torch"}, {"tokenizers"}],
    ids=["bare-install", "no-torch", "no-tokenizers"],
)
def test_omni_worker_without_the_worker_extra_names_it(blocked: set[str]) -> None:
    done = run_script("omni-worker", ["--model-path", "/nonexistent"], blocked)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("omni-worker needs the worker extra: pip install 'omni-router[worker]'"), lines[0]
    assert all(name in lines[0] for name in blocked)
    # The launcher stopped before importing any of the worker's modules.
    assert not {m for m in loaded(done) if m.startswith("worker.")} - {"worker.launcher"}


def test_omni_worker_with_the_extra_runs_the_worker_cli() -> None:
    done = run_script("omni-worker", ["--version"], set())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"omni-worker {__version__}"
    assert "worker.cli" in loaded(done)


def test_omni_router_k8s_discovery_without_the_k8s_extra_refuses_to_start() -> None:
    argv = ["--service-discovery", "k8s", "--selector", "app=omni-worker", "--port", "0"]
    done = run_script("omni-router", argv, {"lightkube"})
    # Without the check the router would serve (and never exit): the timeout would fail this test.
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot start: --service-discovery k8s needs the k8s extra: pip install 'omni-router[k8s]'" in lines[0]
    assert not {m for m in loaded(done) if m.startswith("lightkube")}


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--state-store", "k8s"], "--state-store k8s"),
        (["--state-store", "k8s", "--leader-election"], "--leader-election"),
    ],
    ids=["state-store", "leader-election"],
)
def test_omni_router_k8s_state_or_election_without_the_k8s_extra_refuses_to_start(argv: list[str], flag: str) -> None:
    done = run_script("omni-router", [*argv, "--port", "0"], {"lightkube"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"cannot start: {flag} needs the k8s extra: pip install 'omni-router[k8s]'" in lines[0]
    assert not {m for m in loaded(done) if m.startswith("lightkube")}


def test_omni_router_without_the_k8s_extra_needs_it_only_for_k8s_discovery() -> None:
    done = run_script("omni-router", ["--version"], {"lightkube", "httpx2", "torch"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"omni-router {__version__}"


def test_require_client_passes_where_the_extra_is_installed() -> None:
    pytest.importorskip("lightkube")
    require_client()
