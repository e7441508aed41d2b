"""Test tiers, set on every test from what it uses, and the order test files run in.

- ``unit``: no process, no event loop; a function of the project called directly.
- ``inprocess``: an aiohttp app (router or worker) in this process, through ``pytest-aiohttp``.
- ``process``: starts real processes (workers, routers, trainers), through a fixture or in its body.
- ``gpu``: needs CUDA (marked by hand; skipped on a machine without it).

A test is ``process`` when a fixture it uses, directly or through another, starts processes (declared
with :func:`process_fixture`), or when it is marked so (``@pytest.mark.process`` on a test or class
that starts processes in its body; ``pytestmark`` for a module that does throughout). The tier is
enforced: a test not marked ``process`` that starts a process fails, naming the module to mark, so
``make test-fast`` (``-m "not process and not gpu"``) never waits on a process.

Test files are spread over the pytest processes one file at a time (``--dist loadfile``) in
collection order; the files with the most process tests go first, so no long file starts last while
the other pytest process idles. A file whose few tests run long (a fuzz run, the demo) says how many
process tests it weighs with ``pytestmark = pytest.mark.schedule_weight(n)``. xdist would otherwise
hand files out by their number of tests (``--loadscope-reorder``, its default), which puts such a
file late: that reordering is turned off here, so the order set here is the one the workers get.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

TIERS = ("unit", "inprocess", "process", "gpu")
#: Names of the fixtures that start real processes: filled by :func:`process_fixture` as modules load.
PROCESS_FIXTURES: set[str] = set()
#: The client and engine tiers (tests/clients, tests/engines) run released code in real processes throughout.
PROCESS_DIRS = frozenset({"clients", "engines"})
#: Fixtures that serve an aiohttp app in this process.
INPROCESS_FIXTURES = frozenset({"aiohttp_client", "aiohttp_server", "aiohttp_raw_server", "aiohttp_unused_port"})


def process_fixture(*args: Any, **kwargs: Any) -> Callable[[F], F]:
    """``pytest.fixture`` for a fixture that starts real processes: every test using it, directly or
    through another fixture, is in the ``process`` tier."""

    def declare(function: F) -> F:
        PROCESS_FIXTURES.add(kwargs.get("name") or function.__name__)
        return pytest.fixture(*args, **kwargs)(function)  # type: ignore[no-any-return]

    return declare


def tier_of(item: pytest.Item) -> str:
    if item.get_closest_marker("gpu"):
        return "gpu"
    names = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("process") or names & PROCESS_FIXTURES or item.path.parent.name in PROCESS_DIRS:
        return "process"
    function = getattr(item, "function", None)
    if names & INPROCESS_FIXTURES or inspect.iscoroutinefunction(function):
        return "inprocess"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in (
        ("unit", "no process, no event loop (set automatically)"),
        ("inprocess", "an aiohttp app served in the test process (set automatically)"),
        ("process", "starts real processes (set from process fixtures, or marked on tests that start them)"),
    ):
        config.addinivalue_line("markers", f"{tier}: {what}")
    config.addinivalue_line(
        "markers", "schedule_weight(n): the file weighs n process tests when files are ordered heaviest first"
    )
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weight: Counter[str] = Counter()
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
        declared = item.get_closest_marker("schedule_weight")
        if declared is not None:
            weight[item.nodeid.split("::")[0]] = declared.args[0]
        else:
            weight[item.nodeid.split("::")[0]] += tier == "process"
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], index)
    # Stable: tests keep their order inside a file; files go heaviest first.
    items.sort(key=lambda it: (-weight[it.nodeid.split("::")[0]], first_seen[it.nodeid.split("::")[0]]))


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """Refuse to start a process while ``item`` sets up, runs or tears down, unless its tier starts them."""
    tier = tier_of(item)
    if tier in ("process", "gpu"):
        yield
        return
    from demo import launch
    from tests import procs

    module = item.nodeid.split("::")[0]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"{item.nodeid} is tiered {tier!r} but started a process: mark it "
            f"`@pytest.mark.process` (or {module} with `pytestmark`), or start it in a `process_fixture`"
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(launch.ManagedProcess, "start", refuse)
        patch.setattr(procs.ManagedProcess, "start", refuse)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_processes(item):
        return (yield)
