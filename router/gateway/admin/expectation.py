"""What the caller of a weight change said it leaves on the workers (the router checks it: :mod:`.verify`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.contract.errors import BadRequest
from router.contract.weight_digest import DIGEST, EXPECTED_CHANGE_HEADER, EXPECTED_CHECKSUM_HEADER, ExpectedChange


@dataclass(frozen=True, slots=True)
class Expectation:
    """What the caller said the update leaves on the workers."""

    checksum: str | None = None
    """The digest every target must hold afterwards (lower-case hex), or ``None``: not said."""
    change: ExpectedChange = "changed"

    @classmethod
    def of_headers(cls, headers: Mapping[str, str], *, changes_weights: bool) -> Expectation:
        """The caller's headers read (400 for a malformed value, or for either header on a route that changes
        no weights: nothing there could be checked)."""
        checksum = headers.get(EXPECTED_CHECKSUM_HEADER)
        change = headers.get(EXPECTED_CHANGE_HEADER)
        if checksum is None and change is None:
            return NOTHING_SAID
        if not changes_weights:
            raise BadRequest(
                f"{EXPECTED_CHECKSUM_HEADER} and {EXPECTED_CHANGE_HEADER} belong on a route that changes weights"
            )
        if checksum is not None and not DIGEST.fullmatch(checksum.strip()):
            raise BadRequest(f"{EXPECTED_CHECKSUM_HEADER} must be a hexadecimal digest (16 to 128 digits)")
        if change is not None and change.strip().lower() not in ("changed", "unchanged"):
            raise BadRequest(f"{EXPECTED_CHANGE_HEADER} must be 'changed' or 'unchanged'")
        said: ExpectedChange = (
            "unchanged" if change is not None and change.strip().lower() == "unchanged" else "changed"
        )
        return cls(checksum.strip().lower() if checksum is not None else None, said)


NOTHING_SAID = Expectation()
