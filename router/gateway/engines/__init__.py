"""One adapter per inference engine the router fronts, behind a name-keyed table.

See :mod:`router.gateway.engines.base` for what an engine adapter covers; :data:`ENGINES` maps each
:data:`~router.contract.fleet.EngineName` to its adapter, and :func:`engine_of` finds a worker's.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.contract.errors import BadRequest
from router.contract.fleet import EngineName
from router.gateway.engines.base import Engine
from router.gateway.engines.detect import detect
from router.gateway.engines.omni import OmniEngine
from router.gateway.engines.sglang import SglangEngine
from router.gateway.engines.vllm import VllmEngine
from router.gateway.fleet.registry import Worker

ENGINES: dict[EngineName, Engine] = {e.name: e for e in (OmniEngine(), VllmEngine(), SglangEngine())}
#: Engine → the generation routes its servers serve (``None``, an engine not known yet: none), for the proxy.
GENERATION_PATHS: dict[EngineName | None, frozenset[str]] = {
    None: frozenset(),
    **{name: e.generation_paths for name, e in ENGINES.items()},
}

__all__ = ["ENGINES", "GENERATION_PATHS", "Engine", "detect", "engine_of", "refuse_unserved", "serves"]


def engine_of(worker: Worker) -> Engine | None:
    """The worker's engine adapter, ``None`` while the engine is not known."""
    return ENGINES[worker.engine] if worker.engine is not None else None


def serves(worker: Worker, path: str) -> bool:
    """Whether the worker's server serves the admin route ``path`` (a worker whose engine is not known yet is
    not judged: it gets the call, and fails it if it cannot answer)."""
    engine = engine_of(worker)
    return engine is None or path in engine.admin_paths_of(worker)


def refuse_unserved(targets: Iterable[Worker], path: str) -> None:
    """400 naming every target whose engine does not serve ``path``; nothing was locked or sent yet."""
    missing = [w for w in targets if not serves(w, path)]
    if missing:
        names = ", ".join(f"{w.id} ({w.engine})" for w in missing)
        raise BadRequest(
            f"{path} is not served by {len(missing)} target(s): {names}; a fleet takes only the routes its "
            "engines serve (docs/engines.md lists them). Nothing was sent",
            unserved=[w.id for w in missing],
        )
