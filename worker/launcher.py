"""The ``omni-worker`` console script: check the worker extra is installed, then run :mod:`worker.cli`.

A bare ``pip install omni-router`` installs this package without torch. Started there, the worker
would fail at its first import with a traceback; this launcher imports nothing of the worker until
the extra's modules import, and otherwise exits 2 with one line naming the extra.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: The modules the ``worker`` extra brings (``pip install 'omni-router[worker]'``).
WORKER_EXTRA_MODULES = ("torch", "safetensors", "tokenizers", "jinja2")
EXTRA_MISSING = "omni-worker needs the worker extra: pip install 'omni-router[worker]'"


def missing_modules(names: Sequence[str] = WORKER_EXTRA_MODULES) -> list[str]:
    """The modules of ``names`` that do not import here."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_modules()
    if missing:
        print(f"{EXTRA_MISSING} (cannot import {', '.join(missing)})", file=sys.stderr)
        return 2
    from worker.cli import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
