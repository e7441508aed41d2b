"""The dependency direction between the project's packages, checked on the source (docs/architecture.md).

Every module under ``router/`` and ``worker/`` is parsed with :mod:`ast`; every import counts, wherever it
stands: at module level, inside a function, or under ``if TYPE_CHECKING:``. The rules:

- ``worker`` takes from ``router`` only the shared wire contract (``router.contract``), its torch half
  (``router.dataplane``) and ``router.__version__``; never ``router.gateway`` or ``router.trainer``;
- ``router`` never imports ``worker``;
- ``router.contract`` imports no other project package; ``router.gateway`` and ``router.dataplane``
  import only ``router.contract`` (and ``router.__version__``);
- ``router.gateway`` and ``router.contract`` never reach torch, directly or through any project module
  they import (followed transitively, with the parent packages each import runs);
- no import cycles among project modules.

A subprocess also checks the runtime fact the torch rule is for: importing the gateway loads no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "worker")
#: What the worker may import from ``router``: these packages and everything under them.
WORKER_MAY_USE = ("router.contract", "router.dataplane")
#: Modules of the optional heavy dependencies the torch rule forbids (torch's own submodules included).
TORCH = "torch"


@dataclass(frozen=True)
class Import:
    """One import statement's target, as a dotted module (``from a import b`` is ``a.b`` when that is a module)."""

    target: str
    names: tuple[str, ...]
    """For ``from X import a, b``: ``("a", "b")`` when X itself is the target; empty otherwise."""
    line: int


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


@cache
def project() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name, is_package = _module_name(path)
            modules[name] = Module(name, path, is_package)
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        for node in ast.walk(tree):  # every import, at any depth: functions and TYPE_CHECKING blocks too
            if isinstance(node, ast.Import):
                module.imports.extend(Import(alias.name, (), node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
                plain: list[str] = []
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        module.imports.append(Import(submodule, (), node.lineno))
                    else:
                        plain.append(alias.name)
                if plain:
                    module.imports.append(Import(base, tuple(plain), node.lineno))
    return modules


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _project_target(target: str) -> str | None:
    """The project module an import target names (``router.x.Y`` of a class re-export is cut to its module)."""
    modules = project()
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def _with_parents(name: str) -> Iterator[str]:
    """``a.b.c`` and the packages its import runs first: ``a``, ``a.b``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def edges(name: str) -> set[str]:
    """The project modules ``name`` imports, as written (no implied parent packages)."""
    found = {_project_target(i.target) for i in project()[name].imports}
    found.discard(None)
    found.discard(name)
    return {f for f in found if f is not None}


def runs(name: str) -> set[str]:
    """Every project module importing ``name`` may execute: the transitive closure over ``edges``, each
    import's parent packages (their ``__init__``) included."""
    seen: set[str] = set()
    stack = list(_with_parents(name))
    while stack:
        current = stack.pop()
        if current in seen or current not in project():
            continue
        seen.add(current)
        for target in edges(current):
            stack.extend(_with_parents(target))
    return seen


def _where(module: Module, imp: Import) -> str:
    return f"{module.path.relative_to(ROOT)}:{imp.line} imports {imp.target}"


def test_the_project_is_found() -> None:
    modules = project()
    for expected in ("router.contract.base", "router.gateway.app", "router.dataplane.buckets", "worker.cli"):
        assert expected in modules
    assert sum(len(m.imports) for m in modules.values()) > 500


def test_worker_uses_only_the_contract_and_the_dataplane_of_router() -> None:
    bad = []
    for module in project().values():
        if not _in(module.name, "worker"):
            continue
        for imp in module.imports:
            if not _in(imp.target, "router"):
                continue
            if any(_in(imp.target, allowed) for allowed in WORKER_MAY_USE):
                continue
            if imp.target == "router" and set(imp.names) <= {"__version__"}:
                continue
            bad.append(_where(module, imp))
    assert not bad, "worker may import only router.contract, router.dataplane and router.__version__:\n" + "\n".join(
        bad
    )


def test_router_never_imports_worker() -> None:
    bad = [
        _where(module, imp)
        for module in project().values()
        if _in(module.name, "router")
        for imp in module.imports
        if _in(imp.target, "worker")
    ]
    assert not bad, "router must not import worker:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("package", "may_use"),
    [("router.contract", ()), ("router.gateway", ("router.contract",)), ("router.dataplane", ("router.contract",))],
)
def test_shared_and_server_packages_import_only_below_them(package: str, may_use: tuple[str, ...]) -> None:
    """The contract imports no other project package; the gateway and the dataplane only the contract."""
    bad = []
    for module in project().values():
        if not _in(module.name, package):
            continue
        for imp in module.imports:
            if not (_in(imp.target, "router") or _in(imp.target, "worker")) or _in(imp.target, package):
                continue
            if any(_in(imp.target, allowed) for allowed in may_use):
                continue
            if imp.target == "router" and set(imp.names) <= {"__version__"}:
                continue
            bad.append(_where(module, imp))
    assert not bad, f"{package} may import only {', '.join(may_use) or 'itself'} of the project:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", ["router.gateway", "router.contract"])
def test_gateway_and_contract_never_reach_torch(package: str) -> None:
    bad = []
    for name in project():
        if not _in(name, package):
            continue
        for reached in sorted(runs(name)):
            module = project()[reached]
            bad.extend(f"{name} → {_where(module, imp)}" for imp in module.imports if _in(imp.target, TORCH))
    assert not bad, f"{package} must not reach torch:\n" + "\n".join(sorted(set(bad)))


def test_the_rules_see_a_torch_import_through_the_graph() -> None:
    """The checks above would catch a violation: the worker and the trainer's sender do reach torch."""
    assert "router.dataplane.buckets" in runs("router.trainer.sender")
    for name in ("worker.cli", "router.trainer.sender"):
        assert any(_in(i.target, TORCH) for m in runs(name) for i in project()[m].imports), name


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), by Tarjan."""
    graph = {name: sorted(edges(name)) for name in project()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for node in graph:
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, "import cycles among project modules:\n" + "\n".join(" ↔ ".join(c) for c in cycles)


@pytest.mark.process
def test_gateway_import_loads_no_torch() -> None:
    """The runtime side: the router server's modules import without torch being loaded."""
    code = (
        "import sys\n"
        "import router.gateway.app, router.gateway.cli, router.contract.endpoints\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
