"""Settings declared once: a dataclass field that is also a command-line flag says so where it is declared.

    port: Annotated[int, Flag("TCP port to listen on")] = 30000
    step_delay_s: Annotated[float, Flag("ms to sleep after each step", name="--step-delay-ms", scale=1000)] = 0.0

A field annotated with a :class:`Flag` is a flag, which takes the rest from the field: its option
string (``--port`` for ``port``), its default, its type (``int``, ``float``, ``str``, ``Path``,
``list``; a ``bool`` is a switch; ``X | None`` is an ``X`` that may stay unset) and its choices (a
``Literal``'s values). :func:`add_flags` adds a dataclass's flags to a parser and :func:`from_args`
builds the dataclass from what the parser read, so a setting's name, default and meaning are written
once, in its dataclass. A field without a flag is not on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one setting is given on the command line (the rest comes from its field)."""

    help: str
    name: str | None = None
    """The option string when it is not ``--`` and the field's name with dashes."""
    dest: str | None = None
    """The parsed namespace's attribute when it is not the one argparse derives from the option string."""
    metavar: str | None = None
    nargs: Literal["*", "+"] | None = None
    """For a ``list`` or ``dict`` setting: how many words the flag takes."""
    parse: Callable[[str], Any] | None = None
    """Turns one word into a value (argparse's ``type``); by default the field's type does."""
    env: str | None = None
    """An environment variable read when the flag is absent or empty (an empty variable is unset too)."""
    empty_is_unset: bool = False
    """An empty value (``--api-key ''``, as a manifest's empty variable expands) leaves the setting ``None``."""
    scale: float = 1.0
    """Units of the flag per unit of the setting: 1000 for a setting in seconds given in milliseconds."""


def key_value(text: str) -> tuple[str, str]:
    """One ``KEY=VALUE`` word (a term of a label selector)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    field: dataclasses.Field[Any]
    spec: Flag
    option: str
    dest: str
    kind: Any
    """The field's type without ``None`` (``Path`` for ``Path | None``)."""


def _options(cls: type[Any]) -> Iterator[_Option]:
    hints = get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if get_origin(hint) is not Annotated:
            continue
        kind, *extras = get_args(hint)
        spec = next((extra for extra in extras if isinstance(extra, Flag)), None)
        if spec is None:
            continue
        if get_origin(kind) in (Union, types.UnionType):
            kind = next(arg for arg in get_args(kind) if arg is not type(None))
        option = spec.name or "--" + f.name.replace("_", "-")
        yield _Option(f, spec, option, spec.dest or option.lstrip("-").replace("-", "_"), kind)


def add_flags(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Add a flag for each of ``cls``'s settings that has one, in the order they are declared."""
    for o in _options(cls):
        spec = o.spec
        text = spec.help + (f"; when unset, ${spec.env} is used" if spec.env else "")
        kwargs: dict[str, Any] = {"dest": o.dest, "help": text.replace("%", "%%")}
        if o.kind is bool:
            if o.field.default is not False:
                raise TypeError(f"{cls.__name__}.{o.field.name}: a switch is off by default")
            parser.add_argument(o.option, action="store_true", **kwargs)
            continue
        if o.field.default_factory is not dataclasses.MISSING:
            default = o.field.default_factory()
        elif o.field.default is not dataclasses.MISSING:
            default = o.field.default
        else:
            default, kwargs["required"] = None, True
        if spec.nargs is not None:
            kwargs["nargs"] = spec.nargs
            default = list(default.items() if isinstance(default, dict) else default)
        elif default is not None and spec.scale != 1.0:
            default = default * spec.scale
        if spec.parse is not None:
            kwargs["type"] = spec.parse
        elif get_origin(o.kind) is Literal:
            kwargs["choices"] = get_args(o.kind)
        elif o.kind in (int, float, Path):
            kwargs["type"] = o.kind
        elif o.kind is not str and get_origin(o.kind) is not list:
            raise TypeError(f"{cls.__name__}.{o.field.name}: a {o.kind} setting needs Flag(parse=...)")
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar
        parser.add_argument(o.option, default=default, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from a parsed command line: each flagged setting from its flag, the others default."""
    values: dict[str, Any] = {}
    for o in _options(cls):
        value = getattr(args, o.dest)
        if o.spec.env is not None and not value:
            value = os.environ.get(o.spec.env) or None
        elif o.spec.empty_is_unset and value == "":
            value = None
        if o.spec.nargs is not None:
            value = get_origin(o.kind)(value)  # the words (pairs, for a dict) as the field's list or dict
        elif value is not None and o.spec.scale != 1.0:
            value = value / o.spec.scale
        values[o.field.name] = value
    return cls(**values)
