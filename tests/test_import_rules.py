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
- no import cycles among project modules;
- inside ``router.gateway``, each sub-package and each root module (``keys.py``, ``config.py``, ...) is one
  unit: the units form no loop, and each imports only units on its floor of :data:`GATEWAY_FLOORS` or below
  (the floors are written in docs/architecture.md, "The gateway's floors").

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

GATEWAY = "router.gateway"
#: The gateway's units (a sub-package, or a module at its root), floor by floor from the bottom: a unit may
#: import units of its own floor (never in a loop) and of the floors below it. A new unit is placed here and in
#: docs/architecture.md ("The gateway's floors").
GATEWAY_FLOORS: tuple[tuple[str, ...], ...] = (
    ("config", "dashboard", "head_rules", "k8s_extra", "leader", "shutdown", "tasks", "upstream"),
    ("serving", "state"),
    ("fleet",),
    ("engines", "metrics_adapters"),
    ("health", "metrics"),
    ("edge", "routing"),
    ("admin", "data_planes"),
    ("discovery", "status", "sync"),
    ("keys",),
    ("catch_up", "frontend", "leadership"),
    ("api",),
    ("app",),
    ("processes",),
    ("cli",),
)
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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


def loops(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, by Tarjan (``graph``: node → the nodes it imports)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
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


def import_cycles() -> list[list[str]]:
    """The import cycles among project modules (no module imports itself: :func:`edges` leaves that out)."""
    return loops({name: sorted(edges(name)) for name in project()})


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


def gateway_unit(name: str) -> str | None:
    """The gateway unit a module belongs to: its sub-package, or itself for a module at the gateway's root."""
    if not name.startswith(GATEWAY + "."):
        return None
    return name[len(GATEWAY) + 1 :].split(".")[0]


def gateway_imports() -> dict[str, dict[str, list[str]]]:
    """Unit → the other units it imports → where (``file:line imports target``), every import counted."""
    found: dict[str, dict[str, list[str]]] = {}
    for module in project().values():
        unit = gateway_unit(module.name)
        if unit is None:
            continue
        targets = found.setdefault(unit, {})
        for imp in module.imports:
            target = _project_target(imp.target)
            other = gateway_unit(target) if target is not None else None
            if other is not None and other != unit:
                targets.setdefault(other, []).append(_where(module, imp))
    return found


def gateway_loops(imports: dict[str, dict[str, list[str]]]) -> list[str]:
    """Each loop among the units, with the imports that close it."""
    found = []
    for loop in loops({unit: sorted(targets) for unit, targets in imports.items()}):
        inside = set(loop)
        lines = [
            f"  {where}"
            for unit in loop
            for other, wheres in sorted(imports[unit].items())
            if other in inside
            for where in wheres
        ]
        found.append(" ↔ ".join(loop) + ":\n" + "\n".join(lines))
    return found


def test_gateway_units_form_no_loop() -> None:
    found = gateway_loops(gateway_imports())
    assert not found, "loops among router.gateway's sub-packages and root modules:\n" + "\n".join(found)


def test_gateway_units_import_only_their_floor_or_below() -> None:
    floor_of = {unit: floor for floor, units in enumerate(GATEWAY_FLOORS) for unit in units}
    imports = gateway_imports()
    unplaced = sorted(set(imports) - set(floor_of))
    assert not unplaced, f"place these router.gateway units in GATEWAY_FLOORS and docs/architecture.md: {unplaced}"
    assert not set(floor_of) - set(imports), "GATEWAY_FLOORS names units that do not exist"
    upward = [
        f"{unit} (floor {floor_of[unit]}) → {other} (floor {floor_of[other]}): {where}"
        for unit, targets in sorted(imports.items())
        for other, wheres in sorted(targets.items())
        if floor_of[other] > floor_of[unit]
        for where in wheres
    ]
    assert not upward, "router.gateway units importing above their floor:\n" + "\n".join(upward)


def written_floors() -> list[tuple[str, ...]]:
    """The floors as docs/architecture.md writes them: the table under "The gateway's floors", bottom row first;
    its second column names the units in backquotes (a package with a trailing ``/``, a module with ``.py``)."""
    text = ARCHITECTURE.read_text()
    section = text.split("### The gateway's floors", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    floors = []
    for row in rows:
        names = row.split("|")[2].split("`")[1::2]
        floors.append(tuple(sorted(name.removesuffix("/").removesuffix(".py") for name in names)))
    return floors


def test_the_floors_are_the_ones_docs_architecture_writes() -> None:
    assert written_floors() == [tuple(sorted(units)) for units in GATEWAY_FLOORS]


def test_the_gateway_rules_see_a_loop_and_an_import_upward() -> None:
    """The checks above would catch a loop coming back: one added import up the floors closes one."""
    imports = gateway_imports()
    assert "admin" in imports["sync"] and "keys" in imports["api"]
    imports["admin"].setdefault("sync", []).append("router/gateway/admin/x.py:1 imports router.gateway.sync.x")
    found = gateway_loops(imports)
    assert len(found) == 1 and found[0].startswith("admin ↔ sync:"), found
