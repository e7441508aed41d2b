"""Weight-version policies: which recorded fleet versions a generation request may be served from.

A policy resolves, against the fleet's history (:mod:`router.gateway.fleet.weights`), to the
lowest *sequence number* it admits (its *floor*); a worker is eligible when it is routable
(healthy, not disabled, fenced or departed) and verified on a recorded entry at or above the
floor. Invariants:

- ``latest-only`` (the default) admits exactly the workers the fleet's current entry was
  recorded on: the router's rule before policies existed.
- A worker holding weights the router never recorded (restarted, joined since, partial,
  changed behind the router) is eligible under no policy, ``any`` included.
- Staleness counts fleet entries (sequence numbers), never labels: a reused label cannot make
  old weights look new.
- Parsing a policy changes nothing; a bad one is a 400 before any worker is picked.
- A paused or sleeping worker (as the router's own broadcasts left it) is picked only when no
  eligible worker is running: the request then waits at the worker until it continues, as SGLang
  holds requests sent during a pause.

Floors are cached per record and policy text (:attr:`FleetWeights.floors`), so a request pays a
dictionary lookup, not a walk of the history.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from router.contract.errors import BadRequest, NotFound, Unavailable

# The grammar sits in the contract, below the router's settings, which check --version-policy with it.
from router.contract.version_policy import POLICY_HEADER, VersionPolicy, parse_version_policy
from router.gateway.engines import GENERATION_PATHS
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.fleet.weights import BOOT_SEQUENCE, FleetWeights

#: Why a worker was left out of a request's candidates (the ``reason`` label of the metric).
FILTER_REASONS = ("paused", "fenced", "unhealthy", "pending", "stale", "unversioned", "engine", "adapter")

_MAX_CACHED_FLOORS = 256


#: Header values already parsed: a trainer sends the same few on every request (bounded, cleared when full).
_PARSED: dict[str, VersionPolicy] = {}
_MAX_PARSED = 256


def policy_from_headers(value: str | None, default: VersionPolicy) -> VersionPolicy:
    """The policy a request asked for (``value`` is its header, ``None`` when absent); 400 when bad."""
    if value is None:
        return default
    policy = _PARSED.get(value)
    if policy is not None:
        return policy
    try:
        policy = parse_version_policy(value)
    except ValueError as exc:
        raise BadRequest(f"{POLICY_HEADER}: {exc}") from None
    if len(_PARSED) >= _MAX_PARSED:
        _PARSED.clear()
    _PARSED[value] = policy
    return policy


#: A label's trailing integer, as trainers write versions: ``step-12``, ``v12``, ``rollout_12``, ``12``.
_TRAILING_INTEGER = re.compile(r"(\d{1,18})$")


def _number(label: str | None) -> float | None:
    """The number a label stands for: the label itself when it is one (``1.5``), else its trailing integer."""
    if label is None:
        return None
    try:
        value = float(label)
    except ValueError:
        found = _TRAILING_INTEGER.search(label)
        return float(found.group(1)) if found is not None else None
    return value if math.isfinite(value) else None


def floor_of(policy: VersionPolicy, fleet: FleetWeights) -> int | None:
    """The lowest fleet sequence ``policy`` admits now; ``None`` when it admits none (a ``min-version``
    above every recorded one). 400 for a ``min-version`` that names no recorded version and is no number."""
    floors = fleet.floors
    key = policy.text
    if key in floors:
        return floors[key]
    floor = _resolve(policy, fleet)
    if len(floors) >= _MAX_CACHED_FLOORS:
        floors.clear()
    floors[key] = floor
    return floor


def _resolve(policy: VersionPolicy, fleet: FleetWeights) -> int | None:
    latest = fleet.latest_sequence
    if policy.kind == "latest-only":
        return latest
    if policy.kind == "max-staleness":
        return max(latest - policy.staleness, BOOT_SEQUENCE)
    if policy.kind == "any":
        return BOOT_SEQUENCE
    wanted = policy.min_version or ""
    known = fleet.sequence_of(wanted)
    if known is not None:
        return known
    target = _number(wanted)
    record = fleet.record
    history = record.history if record is not None else []
    if target is None:
        labels = sorted({e.weight_version for e in history if e.weight_version is not None})
        raise BadRequest(
            f"{POLICY_HEADER}: min-version {wanted[:100]!r} is not a version the router recorded, and has no number "
            f"to compare; recorded versions: {', '.join(labels) or 'none yet'}",
            known_versions=labels,
        )
    for entry in history:  # oldest first: the first entry at or above the number, and everything after it
        number = _number(entry.weight_version)
        if number is not None and number >= target:
            return entry.sequence
    return None


def rejection(registry: WorkerRegistry, worker: Worker, floor: int | None) -> str | None:
    """Why ``worker`` may not serve under a policy with this floor (one of :data:`FILTER_REASONS`), or ``None``."""
    if worker.health != "healthy":
        return "unhealthy"
    if worker.disabled or worker.removed or worker.departed is not None:
        return "fenced"
    if worker.paused_behind_router:
        return "paused"
    sequence = registry.fleet.verified_sequence(worker.id, worker)
    if sequence is None:
        return registry.fleet.why_unverified(worker.id, worker)[0]
    if floor is None or sequence < floor:
        return "stale"
    return None


def _serves(registry: WorkerRegistry, worker: Worker, floor: int | None) -> bool:
    """``rejection(...) is None``, without building a reason: the per-request path."""
    if worker.health != "healthy" or worker.disabled or worker.removed or worker.departed is not None:
        return False
    if worker.reported_paused is True and not (worker.paused or worker.asleep):  # paused behind the router
        return False
    sequence = registry.fleet.verified_sequence(worker.id, worker)
    return sequence is not None and floor is not None and sequence >= floor


def admits(registry: WorkerRegistry, policy: VersionPolicy, worker: Worker) -> bool:
    """Whether ``worker`` may still take a request picked for ``policy`` (checked again at its first byte)."""
    try:
        floor = floor_of(policy, registry.fleet)
    except BadRequest:
        return False
    return _serves(registry, worker, floor) and (
        not policy.adapters or registry.adapters.holds_all(worker, policy.adapters)
    )


def candidates(
    registry: WorkerRegistry,
    policy: VersionPolicy,
    tried: Collection[str],
    filtered: dict[str, int],
    path: str | None = None,
) -> list[Worker]:
    """The workers a request under ``policy`` may go to (running ones first, see the module docstring).

    ``path``: the generation route asked for; a worker whose engine does not serve it is left out (SGLang has
    no vLLM token route, vLLM no ``/generate``). ``filtered`` counts, by reason, each worker left out (only
    when one is, so a healthy fleet costs nothing)."""
    floor = floor_of(policy, registry.fleet)
    running: list[Worker] = []
    paused: list[Worker] = []
    for worker in registry.workers():
        if tried and worker.id in tried:
            continue
        if path is not None and path not in GENERATION_PATHS[worker.engine]:
            filtered["engine"] = filtered.get("engine", 0) + 1
        elif not _serves(registry, worker, floor):
            reason = rejection(registry, worker, floor) or "fenced"
            filtered[reason] = filtered.get(reason, 0) + 1
        elif policy.adapters and not registry.adapters.holds_all(worker, policy.adapters):
            filtered["adapter"] = filtered.get("adapter", 0) + 1
        elif worker.paused or worker.asleep:
            paused.append(worker)
        else:
            running.append(worker)
    if running and paused:
        filtered["paused"] = filtered.get("paused", 0) + len(paused)
    return running or paused


def refuse_unserved_route(registry: WorkerRegistry, path: str) -> None:
    """404 when the fleet's engines are known and none of them serves the generation route ``path`` (a vLLM
    fleet has no ``/generate``); a fleet that may still serve it later (an engine not known yet) is left to
    the 503 of :func:`refusal`."""
    engines = {w.engine for w in registry.workers()}
    if not engines or None in engines or any(path in GENERATION_PATHS[e] for e in engines):
        return
    names = ", ".join(sorted(e for e in engines if e is not None))
    raise NotFound(f"{path} is served by none of the fleet's engines ({names}); see docs/engines.md for their routes")


def refusal(registry: WorkerRegistry, policy: VersionPolicy, fleet_state: str) -> Unavailable:
    """The 503 when no worker is eligible: which policy was asked, who holds which version, and why each
    worker was left out. ``fleet_state`` is the message of ``latest-only`` (the fleet's routability)."""
    fleet = registry.fleet
    try:
        floor = floor_of(policy, fleet)
    except BadRequest:
        floor = None
    held: dict[str, dict[str, object]] = {}
    for worker in registry.workers():
        sequence = fleet.verified_sequence(worker.id, worker)
        held[worker.id] = {
            "weight_version": worker.weight_version,
            "fleet_sequence": sequence,
            "staleness": None if sequence is None else fleet.latest_sequence - sequence,
            "left_out": rejection(registry, worker, floor),
        }
    if policy.adapters:
        names = ", ".join(sorted(policy.adapters))
        holding = [w.id for w in registry.workers() if registry.adapters.holds_all(w, policy.adapters)]
        message = (
            f"no routable worker holds LoRA adapter(s) {names} at the fleet's version (held by: "
            f"{', '.join(holding) or 'none'}); {fleet_state}"
        )
    elif policy.kind == "latest-only":
        message = fleet_state
    else:
        parts = []
        for wid, h in held.items():
            on = "unrecorded weights" if h["fleet_sequence"] is None else f"fleet version {h['fleet_sequence']}"
            parts.append(f"{wid} on {on} ({h['weight_version']!r}, {h['left_out'] or 'eligible'})")
        latest = fleet.record.weight_version if fleet.record is not None else None
        message = (
            f"no worker is eligible under version policy {policy.text!r} (the fleet is at version "
            f"{fleet.latest_sequence}, {latest!r}): {'; '.join(parts) or 'no workers are registered'}"
        )
    return Unavailable(message, version_policy=policy.text, fleet_sequence=fleet.latest_sequence, workers=held)
