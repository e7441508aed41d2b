"""The worker selector of smg's RL API (``?selector=...``), parsed once and matched over worker labels.

Grammar (Kubernetes label-selector style, as smg's examples write it)::

    selector := clause ("," clause)*
    clause   := key "=" value | key "==" value | key "!=" value
              | key "in" "(" value ("," value)* ")" | key "notin" "(" value ("," value)* ")"

Clauses are ANDed. Keys are the facts the router knows of a worker (:data:`KEYS`); any other key is
a refusal (smg's ``invalid_selector``), never a selector that silently matches nothing. A fact the
worker does not have (``role``: omni-worker registers no role; a ``weight_version`` not read yet)
is absent: ``=`` and ``in`` do not match it, ``!=`` and ``notin`` do, as in Kubernetes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

#: The keys a clause may name: smg's, plus ``id`` and ``health``.
KEYS = frozenset(
    {
        "engine",
        "role",
        "model",
        "model_id",
        "tp_size",
        "dp_size",
        "pp_size",
        "weight_version",
        "control",
        "health",
        "id",
    }
)
#: The longest selector accepted (a query parameter, not a document).
MAX_SELECTOR_CHARS = 2048

Op = Literal["=", "!=", "in", "notin"]

_CLAUSE = re.compile(
    r"""^\s*(?P<key>[A-Za-z_][A-Za-z0-9_.]*)\s*
        (?:(?P<eq>==|=|!=)\s*(?P<value>[^,()=!]*?)
          |\s(?P<set>in|notin)\s*\((?P<values>[^()]*)\))\s*$""",
    re.VERBOSE,
)


class SelectorError(ValueError):
    """The selector text is not in the grammar."""


@dataclass(frozen=True, slots=True)
class Clause:
    key: str
    op: Op
    values: frozenset[str]

    def matches(self, facts: Mapping[str, str | None]) -> bool:
        value = facts.get(self.key)
        inside = value is not None and value in self.values
        return inside if self.op in ("=", "in") else not inside


@dataclass(frozen=True, slots=True)
class Selector:
    """A parsed selector: every clause must match."""

    text: str
    clauses: tuple[Clause, ...]

    def matches(self, facts: Mapping[str, str | None]) -> bool:
        return all(c.matches(facts) for c in self.clauses)


def _split_clauses(text: str) -> list[str]:
    """Split at the commas outside parentheses (``engine in (sglang,vllm), tp_size=1``)."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
            if depth > 1:
                raise SelectorError("nested parentheses")
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError("')' without '('")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SelectorError("'(' without ')'")
    parts.append(text[start:])
    return parts


def _clause(raw: str) -> Clause:
    found = _CLAUSE.match(raw)
    if found is None:
        raise SelectorError(f"cannot parse clause {raw.strip()!r} (expected key=value, key!=value or key in (a,b))")
    key = found["key"]
    if key not in KEYS:
        raise SelectorError(f"unknown key {key!r} (known: {', '.join(sorted(KEYS))})")
    if found["eq"] is not None:
        value = found["value"].strip()
        if not value:
            raise SelectorError(f"clause {raw.strip()!r} has no value")
        return Clause(key, "!=" if found["eq"] == "!=" else "=", frozenset({value}))
    values = frozenset(v.strip() for v in found["values"].split(","))
    if "" in values:
        raise SelectorError(f"clause {raw.strip()!r} has an empty value in its set")
    return Clause(key, "in" if found["set"] == "in" else "notin", values)


def parse_selector(text: str) -> Selector:
    """Parse ``text``; :class:`SelectorError` says what is wrong. An empty text is an error too."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(f"longer than {MAX_SELECTOR_CHARS} characters")
    if not text.strip():
        raise SelectorError("empty selector")
    return Selector(text, tuple(_clause(part) for part in _split_clauses(text)))
