"""The keywords of one weight sync, declared once for both clients' ``sync_weights``.

``RouterClient.sync_weights`` and ``AsyncRouterClient.sync_weights`` take
``buckets`` and ``broadcast`` and then these keywords, which they hand to
:class:`~router.trainer.driver.WeightSync` unchanged; a type checker checks each
one a caller passes, and ``WeightSync`` documents their defaults.
"""

# No ``from __future__ import annotations``: TypedDict reads ``Required`` from evaluated annotations
# (its ``__required_keys__``), and string annotations would hide it.
from typing import Literal, Required, TypedDict

from router.trainer.driver import GroupSpec, Progress


class SyncOptions(TypedDict, total=False):
    """:class:`~router.trainer.driver.WeightSync`'s keywords: ``group`` is required, the rest default."""

    group: Required[GroupSpec]
    protocol: Literal["two_phase", "single_phase"]
    load_format: str | None
    weight_version: str | None
    pause_mode: Literal["abort", "retract", "in_place"]
    atomic: bool | None
    timeout_s: float | None
    verify: bool
    expected_checksum: str | None
    progress: Progress | None
