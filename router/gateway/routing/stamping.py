"""Which weights served a generation answer: the headers the proxy stamps on it.

``X-Weight-Version`` (and smg's ``x-smg-weight-version``) is the serving worker's version as the
router knew it when it picked the worker; for a stream that is the version at its first token,
since the headers leave before it. ``X-Mixed-Weight-Versions: true`` (smg's
``x-smg-mixed-version``) is added only to a buffered ``/generate`` JSON answer of at most
:data:`MIXED_CHECK_MAX_BYTES` whose ``meta_info`` names another version or several spans
(``weight_versions``). Stamping never changes the body.
"""

from __future__ import annotations

import functools
import json
from typing import Any

#: The serving worker's weight version, and whether the answer spans several (ours and smg's spellings).
WEIGHT_VERSION_HEADERS = ("X-Weight-Version", "x-smg-weight-version")
MIXED_VERSION_HEADERS = ("X-Mixed-Weight-Versions", "x-smg-mixed-version")
#: A buffered ``/generate`` answer larger than this is passed through without reading its versions.
MIXED_CHECK_MAX_BYTES = 1 << 20


def stamp_headers(headers: dict[str, str], version: str | None, mixed: bool) -> None:
    """Say which weights served the answer: the serving worker's version, and whether it mixed several."""
    if version is not None:
        for name in WEIGHT_VERSION_HEADERS:
            headers[name] = version
    if mixed:
        for name in MIXED_VERSION_HEADERS:
            headers[name] = "true"


def _versions_in(meta: Any) -> list[Any]:
    """The weight versions one ``meta_info`` names: its ``weight_version`` and each span of ``weight_versions``."""
    if not isinstance(meta, dict):
        return []
    named = [meta["weight_version"]] if "weight_version" in meta else []
    spans = meta.get("weight_versions")
    if isinstance(spans, list):
        named.extend(span.get("version") for span in spans if isinstance(span, dict))
    return named


@functools.lru_cache(maxsize=64)
def _needles(version: str) -> tuple[bytes, ...]:
    """The byte patterns that name ``version`` in an answer (built once per version, not per answer)."""
    value = json.dumps(version).encode()
    needles: list[bytes] = []
    for key in (b'"weight_version"', b'"version"'):
        needles += [key, key + b": " + value, key + b":" + value]
    return tuple(needles)


def answer_mixes_versions(data: bytes, version: str | None) -> bool:
    """Whether a buffered ``/generate`` answer (one result or a batch) names a weight version other than
    ``version``, or several. A body that names only ``version`` is settled by counting bytes, without
    parsing it (nearly every answer); a large or unreadable one counts as not mixed."""
    if len(data) > MIXED_CHECK_MAX_BYTES:
        return False
    if version is not None:
        # Every ``weight_version`` and span ``version`` key followed by exactly ``version``: nothing else named.
        # (A quote inside generated text is escaped, so these keys are never matched inside it.)
        key, spaced, tight, span_key, span_spaced, span_tight = _needles(version)
        count = data.count
        if count(key) == count(spaced) + count(tight) and count(span_key) == count(span_spaced) + count(span_tight):
            return False
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    results = body if isinstance(body, list) else [body]
    named = {str(v) for r in results if isinstance(r, dict) for v in _versions_in(r.get("meta_info"))}
    return len(named) > 1 or (version is not None and bool(named) and named != {version})
