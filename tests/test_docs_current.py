"""The generated reference pages in docs/ match the code they are generated from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_docs_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "generate_tables.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"docs/endpoints.md is stale: run python docs/generate_tables.py\n{proc.stderr}"
