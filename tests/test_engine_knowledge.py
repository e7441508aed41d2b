"""What differs by engine is asked of the engine's class, never decided by its name outside ``engines/``.

Every module of ``router/gateway`` outside ``router/gateway/engines/`` is parsed: a comparison of an
``engine`` (a worker's ``.engine``, or a name ``engine``) with an engine's name, as ``==``, ``!=``, ``in`` or
``not in`` a literal, fails here naming the place. The engines' names are read from the engine table.
"""

from __future__ import annotations

import ast
from pathlib import Path

from router.gateway.engines import ENGINES

GATEWAY = Path(__file__).resolve().parent.parent / "router" / "gateway"
NAMES = frozenset(ENGINES)


def _is_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
        isinstance(node, ast.Name) and node.id == "engine"
    )


def _names_in(node: ast.expr) -> set[str]:
    """The engine names a literal holds: a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)} & NAMES
    return set()


def engine_name_comparisons(source: str) -> list[tuple[int, str]]:
    """Each comparison of an ``engine`` with an engine's name in ``source``: (line, the expression)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_engine(s) for s in sides) and any(_names_in(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_engine_name_is_compared_outside_the_engines() -> None:
    outside = [p for p in sorted(GATEWAY.rglob("*.py")) if "engines" not in p.relative_to(GATEWAY).parts]
    found = [
        f"{path.relative_to(GATEWAY.parent.parent)}:{line}: {text}"
        for path in outside
        for line, text in engine_name_comparisons(path.read_text())
    ]
    assert not found, "ask the engine's class instead (router/gateway/engines/base.py):\n" + "\n".join(found)


def test_the_check_finds_each_form() -> None:
    sample = (
        "a = worker.engine == 'vllm'\n"
        "b = w.engine in ('sglang', 'omni')\n"
        "c = 'omni' != engine\n"
        "d = worker.engine == 'auto'\n"  # not an engine's name
        "e = worker.name == 'vllm'\n"  # not an engine
    )
    assert engine_name_comparisons(sample) == [
        (1, "worker.engine == 'vllm'"),
        (2, "w.engine in ('sglang', 'omni')"),
        (3, "'omni' != engine"),
    ]
